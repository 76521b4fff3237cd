"""app/observe: Prometheus metrics and what an operator watches."""
