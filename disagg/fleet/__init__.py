"""The fleet: inventory, SSH, services, deploy, start/stop/status/logs, routing."""
