"""An encoder-decoder's two stacks folded as pairs of blocks for the search's proxies
(``fold.with_twin``, ``fold.cut_stacks``): the proxy's rest is then the embeddings and the
head, not a whole decoder, which every pipeline stage's estimate used to be charged."""

from __future__ import annotations

import pytest
import torch

import torchweave
from torchweave.models.t5 import T5, T5Config
from torchweave.policies.spec import PlanSpec
from torchweave.search.estimate import estimate
from torchweave.search.proxies import proxy
from torchweave.search.space import Point
from torchweave.sim import parse_cluster
from torchweave.sim.fast.fold import cut_stacks, find_blocks, with_twin


@pytest.fixture(scope="module")
def t5():
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=512, block_size=32, d_model=64, d_kv=16, n_head=4, d_ff=128,
                   n_enc_layer=6, n_dec_layer=6)
    ids = torch.randint(0, cfg.vocab_size, (8, 16))
    return torchweave.capture(T5(cfg), (ids, ids, ids))


def _layers(graph, stack: str) -> set[str]:
    return {n.module.split(".")[1] for n in graph.nodes
            if (n.module or "").startswith(stack + ".") and n.module.split(".")[1].isdigit()}


def test_the_decoder_is_the_encoders_twin_and_both_are_cut(t5):
    base = PlanSpec.parse("dp").build(t5, 1)
    blocks = find_blocks(t5, base, least=4, nested=False)
    assert blocks.prefix == "encoder" and blocks.twin is None
    paired = with_twin(t5, base, blocks)
    assert paired.twin == "decoder" and paired.spans == blocks.spans
    for k in (3, 4):
        g, _ = cut_stacks(t5, base, paired, k)
        assert len(_layers(g, "encoder")) == len(_layers(g, "decoder")) == k
    g, _ = cut_stacks(t5, base, blocks, 3)  # no twin: the decoder stays whole
    assert len(_layers(g, "decoder")) == 6
    assert paired.holds("decoder.3.ff.w") and paired.holds("encoder.0")
    assert not blocks.holds("decoder.3.ff.w") and blocks.holds("encoder.5.attn")
    assert not paired.holds("encoder_norm") and not paired.holds("encoder.final")
    assert paired.index_of("encoder.4.attn.q") == 4 and paired.index_of("decoder.4") is None


def test_the_proxys_rest_no_longer_holds_the_decoder_and_pipelines_are_priced_by_it(t5):
    cluster = parse_cluster("8xA100-80GB-SXM@8")
    base = PlanSpec.parse("dp").build(t5, 1)
    blocks = find_blocks(t5, base, least=4, nested=False)
    one = proxy(t5, blocks, cluster, 1, False, "none", dtype=None, precision="fp32")
    two = proxy(t5, with_twin(t5, base, blocks), cluster, 1, False, "none", dtype=None,
                precision="fp32")
    decoder = sum(v.meta.numel for v in t5.values.values() if v.kind == "param"
                  and v.target.startswith("decoder.") and v.target.split(".")[1].isdigit())
    # the pair's block holds one decoder layer; the rest no decoder layer at all
    assert one.rest_params - two.rest_params == pytest.approx(decoder, rel=0.01)
    assert two.block_params - one.block_params == pytest.approx(decoder / 6, rel=0.01)
    # a pipeline's stages each get a share of both stacks, and each rank sums the
    # gradients of its own share only: a 2-stage pipeline's estimate, with the decoder
    # charged to every stage (one proxy) and shared out (the pair)
    pt = Point(tp=1, pp=2, dp=4, micro=4, schedule="1f1b", virtual=1, recompute="none", zero=0,
               sp=False, split="rule", coshard=0, ep=1)
    assert estimate(pt, two, cluster, 6, precision="fp32").sync_s \
        < estimate(pt, one, cluster, 6, precision="fp32").sync_s
