"""OpenAI's API under /v1: request and answer shapes (`types`), the mapping into
the one request and back out (`routes`), mounted by `disagg.frontends.app`."""
