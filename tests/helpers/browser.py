"""The headless Chromium the dashboard's tests drive through Playwright."""
CHROMIUM = "/usr/bin/chromium"
# As root Chromium needs --no-sandbox; the rest keep it from reaching out to the internet.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
