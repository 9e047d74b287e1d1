"""The cluster seen in a browser: `disagg serve`'s web view at /ui, its data
endpoint, and the gateway's Prometheus /metrics.

`routes(client, api_key)` is a FastAPI router the gateway includes; everything
the page needs (HTML, CSS, JS) ships in `assets/` as package data, nothing is
fetched from elsewhere. `auth` holds the cookie the page signs in with, which
the gateway's guard also checks.
"""

from disagg.frontends.webview.routes import routes

__all__ = ["routes"]
