"""What every agent process runs on: the server loop, its lifeline, thread pools,
metrics, and the BLAS and torch thread shares."""
