"""app/accounts: users, projects, tokens, quotas, the admin surface."""
