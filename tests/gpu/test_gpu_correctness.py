"""On the GPU (bf16, Triton kernels, CUDA graphs): greedy output of tiny random
models of each family follows transformers up to the first near-tie, and
CUDA-graph and eager runs give identical tokens. Skipped without CUDA."""

from __future__ import annotations

import msgspec
import pytest
import torch

from streamer import LLM, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Without tokenizers: the GPU machine has no copy of the default model."""
    from tests.conftest import tiny_family

    # moderate weights: bf16 rounding of large random logits alone would exceed 5e-2
    return tiny_family(tmp_path_factory.mktemp("tiny-gpu"), None, initializer_range=0.05)


def prompts(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, 40000, (int(x),), generator=g).tolist() for x in torch.linspace(5, 300, n)]


def hf_steps(path, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [torch.log_softmax(x[0].float(), -1) for x in out.logits]


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_bf16_greedy_follows_transformers_until_a_near_tie(tiny_models, family):
    """Batched, and one sequence alone: at batch 1 the decode runs the GEMV path, with the
    norms and residual adds fused into the GEMVs."""
    path = tiny_models[family]
    batch = prompts()
    with LLM(str(path), dtype="bfloat16", num_pages=4096) as llm:
        outs = llm.generate(batch, PARAMS) + [llm.generate([batch[-1]], PARAMS)[0]]
    batch = batch + [batch[-1]]
    agreed = 0
    for p, o in zip(batch, outs):
        ref, logps = hf_steps(path, p, PARAMS.max_tokens)
        for i, (a, b) in enumerate(zip(o.token_ids, ref)):
            if a != b:
                # bf16: only a near-tie may part the two (top-2 within 5e-2 in logprob)
                assert abs(logps[i][a] - logps[i][b]) <= 5e-2, (family, i, a, b)
                break
            agreed += 1
    assert agreed >= 0.5 * len(batch) * PARAMS.max_tokens


def test_cuda_graphs_and_eager_give_identical_tokens(tiny_models):
    """Decode graphs, and extend graphs for the prefills: first fresh, then again over a
    cached prefix (shorter chunks after a prefix), then one by one (lone prefills).

    Identical up to an exact tie: a padded graph batch may run another GEMM kernel than
    the eager one, and where bf16 gives two tokens the very same logit (bf16 steps are
    1/16 at |logit| ~ 10; these random models' logits are flat, so about a quarter of
    the positions measured come after such a tie) either is the argmax."""
    path = tiny_models["qwen3"]
    batch = prompts(8)
    shared = [p[:100] + [7, 8, 9] for p in batch[-3:]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    def run(llm):
        out = llm.generate(batch, params) + llm.generate(shared, params)
        return out + [llm.generate([p], params)[0] for p in batch[:3]]

    with LLM(str(path), dtype="bfloat16", cuda_graphs=False, num_pages=4096) as eager:
        a = run(eager)
    with LLM(str(path), dtype="bfloat16", cuda_graphs=True, max_num_seqs=16, num_pages=4096) as graphed:
        runner = graphed.engine.runner
        assert runner.graphs is not None and runner.extend_graphs is not None
        before = runner.extend_graphs.replays  # the warm-up's
        b = run(graphed)
        assert runner.extend_graphs.replays - before >= 5
    compared = 0
    for x, y in zip(a, b):
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)):
            top = x.logprobs[i].top_logprobs
            if abs(top[0][1] - top[1][1]) < 1e-4:
                break  # a tie: the rest of this sequence may differ
            assert s == t, (x.request_id, i)
            compared += 1
    assert compared >= 0.5 * len(a) * params.max_tokens


def test_programmatic_dependent_launch_changes_no_bit(tiny_models, monkeypatch):
    """With PDL (kernels.common.pdl_enabled) each Triton kernel of a step may start while
    the one before it finishes, and waits for it before reading: the same arithmetic, so
    the same bits. A missing wait would read a half-written input, at batch 1 (decode
    graphs of GEMVs) as in a batch. What kernels read before their wait (weights asked of
    L2, STREAMER_L2_PREFETCH; the step's lengths, positions and slots; the router's ids in
    the MoE down GEMV) changes no bit either."""
    path = tiny_models["llama3"]
    batch = prompts(4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)

    import kernels.common
    from kernels.common import pdl_enabled

    monkeypatch.setattr(kernels.common, "PDL", kernels.common.PDL)  # (the engines below set it)
    monkeypatch.setattr(kernels.common, "PREFETCH_BYTES", kernels.common.PREFETCH_BYTES)

    def run(pdl, prefetch="1"):
        monkeypatch.setenv("STREAMER_PDL", pdl)  # (read when an engine is built: streamer.env.use_pdl)
        monkeypatch.setenv("STREAMER_L2_PREFETCH", prefetch)
        with LLM(str(path), dtype="bfloat16", max_num_seqs=8, num_pages=2048) as llm:
            on = pdl == "1" and torch.cuda.get_device_capability()[0] >= 9
            assert pdl_enabled(torch.zeros(1, device="cuda")) == on
            assert (kernels.common.PREFETCH_BYTES > 0) == (prefetch == "1")
            return [llm.generate([p], params)[0] for p in batch] + llm.generate(batch, params)

    on, off, on_no_prefetch = run("1"), run("0"), run("1", prefetch="0")
    for x, y, z in zip(on, off, on_no_prefetch):
        assert x.token_ids == y.token_ids == z.token_ids
        assert [lp.top_logprobs for lp in x.logprobs] == [lp.top_logprobs for lp in y.logprobs]
        assert [lp.top_logprobs for lp in x.logprobs] == [lp.top_logprobs for lp in z.logprobs]


def test_fp8_linear_layers_follow_transformers_with_the_same_roundings(tiny_models):
    """quantization "fp8" on the GPU (cuBLAS's float8 GEMM, row-wise scales; the float8 GEMV at
    batch 1): greedy output
    follows transformers computing the same roundings (tests/oracle.py emulate_w8a8) in bf16,
    up to the first near-tie, batched and at batch 1."""
    from transformers import AutoModelForCausalLM

    from tests.oracle import emulate_w8a8

    path = tiny_models["llama3"]
    batch = prompts()
    with LLM(str(path), dtype="bfloat16", num_pages=4096, quantization="fp8") as llm:
        assert llm.engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        outs = llm.generate(batch, PARAMS) + [llm.generate([batch[-1]], PARAMS)[0]]
    batch = batch + [batch[-1]]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    emulate_w8a8(model)
    agreed = 0
    for p, o in zip(batch, outs):
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids], device="cuda")).logits[0, len(p) - 1 : -1]
        logps = torch.log_softmax(logits.float(), -1)
        for i, a in enumerate(o.token_ids):
            b = int(logps[i].argmax())
            if a != b:
                assert logps[i][b] - logps[i][a] <= 5e-2, (i, a, b)  # only a near-tie may part them
                break
            agreed += 1
    assert agreed >= 0.5 * len(batch) * PARAMS.max_tokens


def test_bf16_embeddings_follow_transformers_beside_graphed_decodes(tiny_models):
    """SamplingParams.embed on the GPU: the prompt's last hidden state (an eager step: the
    decode graphs end in the LM head), batched beside graphed decodes and with a cached prefix
    (its last token alone computed); within bf16 of transformers', decodes unchanged."""
    from transformers import AutoModel

    path = tiny_models["qwen3"]
    batch = prompts(4)
    hf = AutoModel.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        want = [hf(input_ids=torch.tensor([p], device="cuda")).last_hidden_state[0, -1].float().cpu() for p in batch]
    embed = SamplingParams(max_tokens=1, temperature=0, embed=True)
    with LLM(str(path), dtype="bfloat16", num_pages=4096) as llm:
        plain = llm.generate(batch, PARAMS)
        mixed = llm.generate(batch + batch, [PARAMS] * len(batch) + [embed] * len(batch))
        again = llm.generate(batch, embed)  # (the prompts are cached now but for their last token)
    assert [o.token_ids for o in mixed[: len(batch)]] == [o.token_ids for o in plain]
    for outs in (mixed[len(batch):], again):
        for o, w in zip(outs, want):
            got = torch.tensor(o.embedding)
            assert torch.nn.functional.cosine_similarity(got, w, dim=0) > 0.999, o.request_id
    assert all(o.cached_tokens > 0 for o in again if o.prompt_tokens > 16)


def lora_case(tiny_models, tmp_path, max_tokens: int, logprobs: int):
    """The tiny Qwen3, an adapter of q, v and down (moderate weights: bf16), four prompts, and greedy
    params without and with the adapter."""
    from tests.model.lora_files import make_adapter

    base = tiny_models["qwen3"]
    adapter = make_adapter(tmp_path / "one", base, ["q_proj", "v_proj", "down_proj"], rank=8, alpha=16, seed=1,
                           std=0.05)
    plain = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    return base, adapter, prompts(4), plain, msgspec.structs.replace(plain, lora="one")


def test_bf16_lora_requests_beside_graphed_base_decodes(tiny_models, tmp_path):
    """LoRA on the GPU (model/lora.py): decode steps with an adapter's tokens replay graphs of their
    own, the base model's alone the base graphs. Base requests replayed from the graphs give the tokens of an
    engine without adapters, bit for bit; batched beside an adapter's requests (another batch size:
    other GEMM splits, as on the H100 at the thirty-eighth session) both follow their
    runs alone up to a near-tie; the adapter's logits follow the merged model's (transformers,
    bf16) up to a near-tie, and differ from the base model's."""
    from tests.distributed.workload import assert_follows_until_near_tie
    from tests.model.lora_files import merged

    base, adapter, batch, plain_p, lora = lora_case(tiny_models, tmp_path, 24, 5)
    with LLM(str(base), dtype="bfloat16", num_pages=4096) as llm:
        plain = llm.generate(batch, plain_p)
    with LLM(str(base), dtype="bfloat16", num_pages=4096, lora_modules=(f"one={adapter}",)) as llm:
        alone = llm.generate(batch, lora)
        mixed = llm.generate(batch + batch, [plain_p] * len(batch) + [lora] * len(batch))
        base_again = llm.generate(batch, plain_p)  # (graphed: no adapter in the batch)
    assert [o.token_ids for o in base_again] == [o.token_ids for o in plain]
    assert_follows_until_near_tie(mixed[: len(batch)], plain)
    assert_follows_until_near_tie(mixed[len(batch):], alone)
    assert [o.token_ids for o in alone] != [o.token_ids for o in plain]
    want, logps = hf_steps(merged(tmp_path / "merged", base, adapter), batch[0], 24)
    got = alone[0].token_ids
    part = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if part is not None:  # (bf16: only a near-tie may part the two)
        assert abs(logps[part][got[part]] - logps[part][want[part]]) <= 5e-2, (part, got, want)


def test_bf16_lora_steps_replay_graphs_that_follow_eager_steps(tiny_models, tmp_path):
    """An adapter's prefill and decode steps replay the LoRA graphs (each size captured when first
    needed) and follow an engine without CUDA graphs up to a near-tie; mixed with base requests too."""
    from tests.distributed.workload import assert_follows_until_near_tie

    base, adapter, batch, plain_p, lora = lora_case(tiny_models, tmp_path, 24, 5)
    kw = dict(dtype="bfloat16", num_pages=4096, lora_modules=(f"one={adapter}",))
    with LLM(str(base), cuda_graphs=False, **kw) as llm:
        eager = llm.generate(batch + batch, [lora] * len(batch) + [plain_p] * len(batch))
    with LLM(str(base), **kw) as llm:
        graphed = llm.generate(batch + batch, [lora] * len(batch) + [plain_p] * len(batch))
        decode, extend = llm.engine.runner.lora_graphs.current(llm.engine.runner.adapters)
        sizes, tokens = sorted(decode.graphs), sorted(extend.graphs)
    assert sizes and max(sizes) >= len(batch) * 2, sizes  # (the decode steps of both kinds of request)
    assert tokens, "the prompts' steps replay the LoRA extend graphs"
    assert_follows_until_near_tie(graphed, eager)


def test_bf16_lora_loaded_while_serving_equals_one_loaded_at_start(tiny_models, tmp_path):
    """An adapter loaded at run time (engine/adapters.py: its layers changed between steps, after
    the CUDA graphs were captured) gives the tokens and logprobs of the same adapter loaded at
    start, and once unloaded the base model's graphed steps are those of an engine without it."""
    base, adapter, batch, plain_p, lora = lora_case(tiny_models, tmp_path, 16, 3)
    with LLM(str(base), dtype="bfloat16", num_pages=4096, lora_modules=(f"one={adapter}",)) as llm:
        at_start = llm.generate(batch, lora)
    with LLM(str(base), dtype="bfloat16", num_pages=4096, allow_runtime_lora_updating=True) as llm:
        plain = llm.generate(batch, plain_p)
        llm.load_lora("one", str(adapter))
        loaded = llm.generate(batch, lora)
        llm.unload_lora("one")
        after = llm.generate(batch, plain_p)
    assert [o.token_ids for o in loaded] == [o.token_ids for o in at_start]
    assert [[lp.top_logprobs for lp in o.logprobs] for o in loaded] == \
        [[lp.top_logprobs for lp in o.logprobs] for o in at_start]
    assert [o.token_ids for o in after] == [o.token_ids for o in plain]


def test_bf16_lora_graphs_are_recaptured_when_an_adapter_is_replaced(tiny_models, tmp_path):
    """Replacing an adapter (load_inplace) after its decode steps were graphed: the next steps run
    the new adapter's weights (the tokens and logprobs of an engine started with it), not the
    graphs of the old one's."""
    from tests.model.lora_files import make_adapter

    base, adapter, batch, _, lora = lora_case(tiny_models, tmp_path, 16, 3)
    other = make_adapter(tmp_path / "two", base, ["q_proj", "v_proj", "down_proj"], rank=8, alpha=16, seed=2,
                         std=0.05)
    with LLM(str(base), dtype="bfloat16", num_pages=4096, lora_modules=(f"one={other}",)) as llm:
        want = llm.generate(batch, lora)
    with LLM(str(base), dtype="bfloat16", num_pages=4096, allow_runtime_lora_updating=True) as llm:
        llm.load_lora("one", str(adapter))
        first = llm.generate(batch, lora)
        llm.load_lora("one", str(other), replace=True)
        got = llm.generate(batch, lora)
    assert [o.token_ids for o in first] != [o.token_ids for o in want]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [[lp.top_logprobs for lp in o.logprobs] for o in got] == \
        [[lp.top_logprobs for lp in o.logprobs] for o in want]
