import time
from tests.test_ollama import *  # noqa
from tests.test_ollama import served, base, oc, model  # noqa


def test_time_seeded(oc, model):
    story = "Tell me a story about a fox."
    for rep in range(3):
      for n in (1, 2, 4, 8, 20):
        t0 = time.monotonic()
        r = oc.generate(model=model, prompt=story, options={"temperature": 1.0, "seed": 1234, "num_predict": n})
        print(n, round(time.monotonic() - t0, 2), repr(r.response), r.eval_count)
      for n in (20, 10, 7):
        t0 = time.monotonic()
        r = oc.generate(model=model, prompt=QUESTION, options={"temperature": 0, "num_predict": n})
        print("Q", n, round(time.monotonic() - t0, 2), repr(r.response), r.eval_count, r.done_reason)
