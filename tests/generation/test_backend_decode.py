"""transformers' static-cache ``generate`` with its decode step compiled by ``fastops_inductor``
(``CompileConfig(backend="fastops_inductor")``, the way transformers compiles decoding), on CPU:
the tokens equal eager generation's, with the Python and the C++ wrapper, and a second prompt of
the same shape reuses the graph. (transformers compiles on CPU only when asked: ``_compile_all_devices``.)"""

import pytest
import torch
from torch._dynamo.utils import counters

from inductor_ext.bench.train import build_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()


def _generate(model, ids, compile_config=None):
    model.generation_config.compile_config = compile_config
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static",
                              disable_compile=compile_config is None)  # fmt: skip


@pytest.mark.parametrize("options", [None, {"cpp_wrapper": True}], ids=["python_wrapper", "cpp_wrapper"])
def test_static_cache_decode_under_the_backend_equals_eager(options):
    torch.manual_seed(0)
    model = build_model("tiny-llama", "cpu", torch.float32).eval()
    # torch.compile takes a mode or options, not both: options replace the default "reduce-overhead"
    config = transformers.CompileConfig(backend="fastops_inductor", fullgraph=True,
                                        **({"mode": None, "options": options} if options else {}))  # fmt: skip
    config._compile_all_devices = True
    for seed in (1, 2):  # the second prompt (same shape) reuses the compiled decode step
        ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
        eager = _generate(model, ids)
        compiled = _generate(model, ids, config)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert counters["inductor_ext"]["rewrite_rms_norm_hf_llama"] > 0  # our ops ran in the decode step
