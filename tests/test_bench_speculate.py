"""The speculation benchmark's workloads (disagg/bench/speculate.py): the edit reply
starts as a model doing the edit starts it, so the 96 tokens measured are the edit
carried on by the model, not a copy handed to it."""

from __future__ import annotations

from pathlib import Path

from disagg.bench.speculate import edit_file, prompt_ids, workloads


def test_the_edit_reply_starts_with_the_rename_made_and_the_rest_left_to_the_model() -> None:
    text, start = workloads()["edit"]
    file = edit_file()
    assert file in text and "total_count" in file and "running_total" not in file
    head = start.removeprefix("```python\n")
    assert head != start and head.count("def ") == 1  # one function, not the file
    assert "running_total" in head and "total_count" not in head
    assert file.startswith(head.replace("running_total", "total_count").rstrip("\n"))
    assert len(head) < len(file) / 20
    assert workloads()["free"][1] == ""


def test_prompt_ids_end_with_the_reply_start_after_the_generation_prompt(
    default_model: Path,
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model))
    text, start = workloads()["edit"]
    bare, ids = prompt_ids(tok, text), prompt_ids(tok, text, start)
    assert ids[: len(bare)] == bare and tok.decode(ids[len(bare) :]) == start
    assert str(tok.decode(bare)).endswith("<|im_start|>assistant\n")
