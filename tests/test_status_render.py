"""`disagg status` rendering: readable in an 80-column terminal (a short table,
details under it), one wide table where there is room."""

from __future__ import annotations

from rich.console import Console

from disagg.cli.render_fleet import status_table
from disagg.fleet.operations import HostProbe


def _agent(host: str, role: str, model: str, backend: str, device: str) -> HostProbe:
    return HostProbe(
        host=host,
        role=role,
        state="healthy",
        address=f"192.168.100.{11 if 'dgx' in host else 21}:{7100 if role == 'prefill' else 7200}",
        status={
            "model": f"/home/ops/models/fp4/{model}",
            "loaded": True,
            "backend": backend,
            "device": device,
            "uptime_s": 86400.5,
            "requests": 1234,
            "ttft_p50_s": 0.182,
            "ttft_p95_s": 1.104,
            "ttft_p99_s": 5.93,
        },
        pid=4242,
        rss_bytes=17 * 2**30,
    )


ROWS = [
    _agent("dgx-spark-1", "prefill", "Qwen3-Coder-30B-A3B-Instruct-4bit", "torch", "cuda:0"),
    _agent("mac-studio-2", "decode", "Qwen3-Coder-30B-A3B-Instruct-4bit", "mlx", "gpu"),
    _agent("dgx-spark-2", "prefill", "gpt-oss-120b", "torch", "cuda:0"),
    HostProbe(
        "mac-studio-1",
        "decode",
        "not responding",
        detail="connection refused on 192.168.100.22:7201; fix: disagg start mac-studio-1",
    ),
]


def render(width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(status_table(ROWS, width))
    return console.export_text().splitlines()


def test_status_at_80_columns_keeps_every_value_whole() -> None:
    lines = render(80)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    # Each value on one line, never broken into one word per row.
    for whole in (
        "dgx-spark-1",
        "mac-studio-2",
        "not responding",
        "Qwen3-Coder-30B-A3B-Instruct-4bit",
        "torch/cuda:0",
        "192.168.100.21:7200",
        "182.0 ms / 1.104 s / 5.930 s",
    ):
        assert whole in text, whole
    table_rows = [line for line in lines if "dgx-spark-1" in line and "prefill" in line]
    assert table_rows and "healthy" in table_rows[0]
    assert any("connection refused" in line for line in lines)


def test_status_wide_is_one_table() -> None:
    lines = render(240)  # twelve columns, the prefix cache's included
    header = next(line for line in lines if "backend/device" in line)
    assert "memory" in header and "address" in header
    assert any("Qwen3-Coder-30B-A3B-Instruct-4bit" in line for line in lines)
