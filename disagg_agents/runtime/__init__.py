"""What every agent process runs on: its flags and log, both ports (the gate, the
data listener, the control endpoint), start to drain, its lifeline, thread pools,
metrics, and the BLAS and torch thread shares."""
