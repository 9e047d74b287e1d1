"""`disagg deploy` installs what pyproject's role extras say, markers and all."""

from __future__ import annotations

from disagg.fleet.requirements import from_metadata, role_modules, role_requirements


def test_a_linux_decode_host_gets_mlx_cpu() -> None:
    reqs = role_requirements("decode")
    assert any(r.startswith("mlx[cpu]") and "sys_platform == 'linux'" in r for r in reqs)
    assert any(r.startswith("mlx-lm") for r in reqs)
    assert {"mlx", "mlx_lm", "numpy", "zstandard"} <= set(role_modules("decode"))


def test_prefill_gets_torch_and_the_agents_base() -> None:
    names = role_modules("prefill")
    assert {"torch", "transformers", "safetensors", "numpy", "zstandard"} <= set(names)
    assert "mlx" not in names and "typer" not in names  # the control plane stays home


def test_installed_metadata_parses_the_same_way() -> None:
    deps, extras = from_metadata(
        [
            "numpy>=1.26",
            'torch<3,>=2.4; extra == "prefill"',
            'mlx[cpu]>=0.26; sys_platform == "linux" and extra == "decode"',
            'disagg[convert,decode,prefill]; extra == "all"',
        ]
    )
    assert deps == ["numpy>=1.26"]
    assert extras["prefill"] == ["torch<3,>=2.4"]
    assert extras["decode"] == ['mlx[cpu]>=0.26; sys_platform == "linux"']
