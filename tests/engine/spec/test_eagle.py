"""Speculative decoding with EAGLE heads (model/eagle_heads.py, model/eagle_draft.py):
EAGLE-3 (method eagle3) and EAGLE-1/2 (method eagle); the heads here are mostly pickled, as
most published ones are (pytorch_model.bin). Greedy output is the plain greedy output token
for token (batched, chunked, page sizes 1, 4 and 16, preempted, with overlap scheduling);
the heads' proposals are those of independent references (transformers' target features,
the heads' formulas with no KV cache), so their features, their KV one position behind the
target and EAGLE-3's vocabulary map are right; a head that always proposes the target's
token has every proposal kept; what cannot run is refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamer import LLM, SamplingParams
from streamer.errors import ConfigError, ModelLoadError
from streamer.model.eagle_heads import aux_layers
from tests.conftest import make_tiny_model
from tests.engine.spec.checks import PROMPTS, assert_greedy_unchanged
from tests.engine.spec.eagle_heads import (
    agreeing_pair,
    make_eagle1_head,
    make_head,
    reference_eagle1_proposals,
    reference_proposals,
)
from tests.model.test_deepseek import CONFIGS
from tests.oracle import _hf_model

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
IDS = [0, 1, 2]
"""The head reads the outputs of target layers 0, 1 and 2: the inputs of layers 1, 2, 3."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("eagle3")
    target = make_tiny_model(root / "target", "LlamaForCausalLM", default_model, num_hidden_layers=4)
    # (as the published heads of Llama targets are: pickled, their config naming LlamaForCausalLM)
    head = make_head(root / "head", target, draft_vocab=512, layer_ids=IDS, pickle=True,
                     architecture="LlamaForCausalLM")
    return target, head


@pytest.mark.parametrize("method, page_size, pages, overlap",
                         [("eagle3", 1, 60, False), ("eagle3", 16, None, True), ("eagle", 4, 18, True)])
def test_greedy_output_with_an_eagle_head_is_plain_greedy_output(pair, tmp_path, method, page_size, pages, overlap):
    target, head = pair
    if method == "eagle":
        head = make_eagle1_head(tmp_path / "eagle1", target)
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    assert_greedy_unchanged(target, spec, GREEDY, page_size=page_size, pages=pages, overlap=overlap)


FAMILIES = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM"}


DEEPSEEK = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]


def assert_proposals_follow(target, spec: dict, prompts: list[list[int]], reference, **engine: Any) -> int:
    """One request at a time (so that no page is shared), chunked prefill: every proposal of
    every verify step equals reference(transformers' target, tokens up to the verify chunk's
    start, k), but where the reference's top two logits are within 1e-4 (none expected).
    Returns how many proposals were compared. engine: more LLM settings."""
    hf = _hf_model(str(target))
    checked = 0
    with LLM(str(target), max_num_batched_tokens=16, speculative_config=spec, **engine) as llm:
        draft = llm.engine.runner.draft
        seen: list[tuple[int, list[int]]] = []
        propose = draft.propose

        def record(batch):
            batch, proposed = propose(batch)
            for s in batch.seqs:
                if s.num_draft:
                    seen.append((s.start, proposed.drafts[s.request_id]))
            return batch, proposed

        draft.propose = record
        try:
            for prompt in prompts:
                seen.clear()
                seq = prompt + llm.generate([prompt], GREEDY)[0].token_ids
                assert seen
                for start, drafts in seen:
                    want, gaps = reference(hf, seq[: start + 1], len(drafts))
                    for d, w, gap in zip(drafts, want, gaps):
                        assert d == w or gap < 1e-4, (prompt, start, drafts, want, gaps)
                        checked += 1
                        if d != w:
                            break
        finally:
            del draft.propose
    return checked


@pytest.mark.parametrize("family", ["llama", *FAMILIES, *DEEPSEEK])
def test_the_heads_proposals_are_the_references(pair, family, tmp_path):
    """For each decoder family a head can follow: the features are the residual streams
    transformers reports as the layers' inputs."""
    target, head = pair
    if family in DEEPSEEK:  # (a latent KV cache: the head's own pool is a plain one)
        target = make_tiny_model(tmp_path / family, family, None, **dict(CONFIGS[family], num_hidden_layers=4))
    elif family != "llama":
        target = make_tiny_model(tmp_path / family, FAMILIES[family], None, num_hidden_layers=4)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    checked = assert_proposals_follow(
        target, spec, PROMPTS[:2] if family == "llama" else PROMPTS[1:2],
        lambda hf, tokens, k: reference_proposals(hf, head, tokens, k, [i + 1 for i in IDS]))
    assert checked >= (30 if family == "llama" else 15)


@pytest.mark.parametrize("family, fc_bias", [("llama", True), ("qwen3", False)])
def test_an_eagle1_heads_proposals_are_the_references(pair, family, fc_bias, tmp_path):
    """EAGLE-1/2 (method eagle): the feature is the target's output after its final norm, fc
    (with its bias where the checkpoint has one) mixes it with the token's embedding, the first
    layer has no input norm, and the logits are the target's LM head's."""
    target = pair[0] if family == "llama" else make_tiny_model(tmp_path / family, FAMILIES[family], None,
                                                               num_hidden_layers=4)
    head = make_eagle1_head(tmp_path / "eagle1", target, fc_bias=fc_bias)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    checked = assert_proposals_follow(target, spec, PROMPTS[:2],
                                      lambda hf, tokens, k: reference_eagle1_proposals(hf, head, tokens, k))
    assert checked >= 30


def test_a_head_proposing_the_targets_token_has_every_proposal_kept(tmp_path):
    """(agreeing_pair) Every verify keeps its k proposals and the target's next token, and
    the output is the plain output."""
    target, head = agreeing_pair(tmp_path)
    params = SamplingParams(max_tokens=21, temperature=0, ignore_eos=True)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
    with LLM(str(target), page_size=4, speculative_config=spec) as llm:
        s0 = llm.stats()
        out = llm.generate([[5, 6, 7, 8, 9]], params)[0].token_ids
        s1 = llm.stats()
        llm.check()
    assert out == [0] * 21
    assert s1.spec_accepted_tokens - s0.spec_accepted_tokens == s1.spec_draft_tokens - s0.spec_draft_tokens > 0
    assert s1.steps - s0.steps <= 1 + 20 // 5 + 1


def test_sampled_and_grammar_requests_with_an_eagle3_head(pair):
    """Seeded sampled requests reproduce in another batch order (rejection sampling against
    the head's distribution over its vocabulary); a grammar request keeps the plain
    constrained output (the head proposes unconstrained, the rows' masks follow its draws)."""
    from streamer.messages import GrammarSpec

    target, head = pair
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    regex = SamplingParams(max_tokens=8, temperature=0, grammar=GrammarSpec("regex", "(yes|no)[.]"))
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True,
                             repetition_penalty=1.1)
    question = "Is water wet? Answer:"
    with LLM(str(target)) as plain:
        want = plain.generate([question], [regex])[0]
    with LLM(str(target), speculative_config=spec) as llm:
        got = llm.generate([question, PROMPTS[0], PROMPTS[1]], [regex, sampled, sampled])
        again = llm.generate([PROMPTS[1], PROMPTS[0]], [sampled, sampled])[::-1]
        s = llm.stats()
        llm.check()
    assert got[0].token_ids == want.token_ids and got[0].text in ("yes.", "no.")
    assert [o.token_ids for o in got[1:]] == [o.token_ids for o in again]
    assert s.spec_draft_tokens > 0


def test_the_layers_a_head_reads():
    class Cfg:
        eagle_config = None

    assert aux_layers(Cfg(), 32, "x") == (2, 16, 29)  # (without ids: inputs of 2, N // 2, N - 3)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [28, 1, 15]}
    assert aux_layers(Cfg(), 32, "x") == (2, 16, 29)  # (the outputs of those layers, ascending)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 15, 31]}
    with pytest.raises(ModelLoadError, match="trained for another model|for another model"):
        aux_layers(Cfg(), 32, "x")
    Cfg.eagle_config = None
    Cfg.eagle_aux_hidden_state_layer_ids = [2, 16, 29]  # (top level: layer inputs, vLLM's convention)
    assert aux_layers(Cfg(), 32, "x") == (2, 16, 29)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}  # (the same layers: agreed)
    assert aux_layers(Cfg(), 32, "x") == (2, 16, 29)
    Cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}
    with pytest.raises(ModelLoadError, match="name different layers"):
        aux_layers(Cfg(), 32, "x")


def test_what_cannot_run_is_refused_by_name(tmp_path, pair, default_model):
    target, head = pair
    with pytest.raises(ConfigError, match="'eagle3' needs 'model'"):
        LLM(str(target), speculative_config={"method": "eagle3"})
    with pytest.raises(ModelLoadError, match="an EAGLE-3 head, which runs with speculative_config method 'eagle3'"):
        LLM(str(target), speculative_config={"method": "eagle", "model": str(head)})
    named = make_head(tmp_path / "named", target, draft_vocab=512, layer_ids=IDS)
    with pytest.raises(ModelLoadError, match="an EAGLE head, which proposes tokens for the model"):
        LLM(str(named))
    with pytest.raises(ModelLoadError, match="an EAGLE head, which proposes"):  # (not a draft_model either)
        LLM(str(target), speculative_config={"method": "draft_model", "model": str(named)})
    qwen = make_tiny_model(tmp_path / "qwen", "Qwen3ForCausalLM", None, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match="is not a head of speculative_config method 'eagle3'"):
        LLM(str(target), speculative_config={"method": "eagle3", "model": str(qwen)})
    with pytest.raises(ModelLoadError, match="num_hidden_layers 4: an EAGLE-3 head has one decoder layer"):
        LLM(str(target), speculative_config={"method": "eagle3", "model": str(target)})
    other = make_tiny_model(tmp_path / "wide", "LlamaForCausalLM", None, hidden_size=96, num_hidden_layers=4)
    with pytest.raises(ConfigError, match="trained for another model"):
        LLM(str(other), speculative_config={"method": "eagle3", "model": str(head)})
    shallow = make_tiny_model(tmp_path / "shallow", "LlamaForCausalLM", None, num_hidden_layers=2)
    with pytest.raises(ModelLoadError, match="target has 2 layers"):
        LLM(str(shallow), speculative_config={"method": "eagle3", "model": str(head)})
    cohere = make_tiny_model(tmp_path / "cohere", "CohereForCausalLM", None, num_hidden_layers=4)
    with pytest.raises(ConfigError, match="hidden states of CohereForCausalLM's layers"):
        LLM(str(cohere), speculative_config={"method": "eagle3", "model": str(head)})
    two = tmp_path / "two-layers"
    two.mkdir()
    cfg = json.loads((head / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    (two / "pytorch_model.bin").symlink_to(head / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="num_hidden_layers 2: an EAGLE-3 head has one decoder layer"):
        LLM(str(target), speculative_config={"method": "eagle3", "model": str(two)})


class _Replay:
    """A CUDA graph's contract on the CPU: replay reruns the captured step over the static
    input buffers and writes its results into the tensors the capture returned (the static
    outputs: the hidden states, and the model's graph_outputs)."""

    def __init__(self, run, size: int, out):
        self.run, self.size, self.out = run, size, out
        # the input buffer a head's kernels were captured reading (its attribute may change since)
        self.feature = getattr(run.__self__.model, "feature", None)

    def replay(self) -> None:
        owner = self.run.__self__
        static = owner.outputs.get(self.size, {})
        before = {name: getattr(owner.model, name) for name in static}  # (a replay sets no attribute)
        if self.feature is not None:
            before["feature"], owner.model.feature = owner.model.feature, self.feature
        new = self.run(self.size)
        self.out.copy_(new)
        for name, t in static.items():
            t.copy_(owner.outputs[self.size][name])
        for name, value in before.items():
            setattr(owner.model, name, value)
        owner.outputs[self.size] = static


def _capture_on_cpu(sizes, run, pool):
    graphs, outputs = {}, {}
    for n in reversed(sizes):
        outputs[n] = run(n)
        graphs[n] = _Replay(run, n, outputs[n])
    return graphs, outputs, pool


def test_graph_replays_of_the_target_and_the_head_give_the_eager_output(pair, monkeypatch):
    """The CUDA-graph path emulated on the CPU (graphs.capture_ladder replaced by _Replay): the
    target's features and the head's outputs are read from static buffers that each replay
    rewrites, the head's input features copied into its static buffer first. Greedy output and
    every proposal are the eager run's, and graphs served the head's steps and the target's
    decodes."""
    import torch

    from streamer.model import graphs as graphs_module
    from streamer.model.graphs import DecodeGraphs

    target, head = pair
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with LLM(str(target), speculative_config=spec, overlap_schedule=False) as llm:
        runner = llm.engine.runner
        draft = runner.draft
        proposals: list[list[int]] = []
        propose = draft.propose

        def record(batch):
            batch, proposed = propose(batch)
            proposals.extend(proposed.drafts[s.request_id] for s in batch.seqs if s.num_draft)
            return batch, proposed

        draft.propose = record
        want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        eager, proposals = proposals, []
        monkeypatch.setattr(graphs_module, "capture_ladder", _capture_on_cpu)
        max_pages = runner.pool.pages_for(runner.max_model_len)
        with torch.inference_mode():
            runner.graphs = DecodeGraphs(runner.model, runner.pool.k, runner.pool.v, 4, max_pages)
            runner.graphs.capture()
            draft.feature_buf = torch.zeros(4, draft.cfg.hidden_size)
            draft.model.feature = draft.feature_buf
            draft.graphs = DecodeGraphs(draft.model, draft.pool.k, draft.pool.v, 4, max_pages)
            draft.graphs.capture()
        replays = {"target": 0, "head": 0}
        for name, g in (("target", runner.graphs), ("head", draft.graphs)):
            for r in g.graphs.values():
                def counted(r=r, name=name, replay=r.replay):
                    replays[name] += 1
                    replay()
                r.replay = counted
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        llm.check()
        del draft.propose
    assert got == want
    assert proposals == eager, "the head proposes from the graphs' buffers as it does eagerly"
    assert replays["head"] > 0 and replays["target"] > 0, replays


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_a_lora_adapters_requests_keep_their_greedy_output_with_an_eagle_head(pair, tmp_path, method):
    """The head proposes from the target's hidden states (with the request's adapter) and is not
    adapted itself: only the acceptance depends on it; the verify chunks run with the adapter."""
    import torch

    from tests.model.lora_files import make_adapter
    from tests.model.test_lora import ALL

    target, head = pair
    if method == "eagle":
        head = make_eagle1_head(tmp_path / "eagle1", target)
    one = make_adapter(tmp_path / "one", target, ALL, rank=4, alpha=8, seed=1)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 30, 60)]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, lora=name) for name in ("one", None, "one")]
    kw = {"dtype": "float32", "device": "cpu", "lora_modules": (f"one={one}",)}
    with LLM(str(target), **kw) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    spec = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    with LLM(str(target), speculative_config=spec, **kw) as llm:
        outs = llm.generate(prompts, params)
        assert llm.stats().spec_draft_tokens > 0
    assert [o.token_ids for o in outs] == want
