"""CPU tests of how a world keys torch.compile's on-disk caches (python/tdist/_torch_ops.py): no GPU.
They need torch and skip, saying so, without it.

The fakes' output shapes depend on the world's size and rank, which a traced graph's text does not
show; the tag keeps a graph compiled for one world or rank from being loaded by another. The
end-to-end case (a world-1 compile, then two ranks on the same cache) runs on GPUs: scripts/gpu-test
runs gpu_test_ops.py at one rank and then at two sharing the GPU.
"""

import pytest

torch = pytest.importorskip("torch", reason="the compile-cache tag tests need torch")

from tdist import _torch_ops  # noqa: E402


@pytest.fixture
def config():
    cfg = _torch_ops._compiler_config()
    if cfg is None:
        pytest.skip(f"torch {torch.__version__} has no torch.compiler.config.cache_key_tag")
    saved = cfg.cache_key_tag
    yield cfg
    _torch_ops.untag_compile_caches()
    cfg.cache_key_tag = saved


def test_world_size_and_rank_enter_the_tag(config):
    config.cache_key_tag = ""
    _torch_ops.tag_compile_caches(2, 1)
    two = config.cache_key_tag
    assert "world_size=2" in two and "rank=1" in two, two
    _torch_ops.tag_compile_caches(2, 0)  # a new world replaces the old one's part
    assert config.cache_key_tag not in ("", two), config.cache_key_tag
    _torch_ops.tag_compile_caches(1, 0)
    assert "world_size=1" in config.cache_key_tag and "world_size=2" not in config.cache_key_tag
    _torch_ops.untag_compile_caches()
    assert config.cache_key_tag == ""


def test_the_users_tag_is_kept(config):
    config.cache_key_tag = "mine|v2"
    _torch_ops.tag_compile_caches(4, 3)
    assert config.cache_key_tag.startswith("mine|v2|"), config.cache_key_tag
    config.cache_key_tag += "|later"  # the user adds to it while the world is up
    _torch_ops.untag_compile_caches()
    assert config.cache_key_tag == "mine|v2|later"
    _torch_ops.untag_compile_caches()  # nothing of tdist's left: a no-op
    assert config.cache_key_tag == "mine|v2|later"


def test_another_world_in_the_process_resets_dynamo(config, monkeypatch):
    import torch._dynamo

    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    monkeypatch.setattr(_torch_ops, "_last_world", None)
    _torch_ops.tag_compile_caches(2, 0)
    _torch_ops.tag_compile_caches(2, 0)  # the same world again: compiled code stays valid
    assert resets == []
    _torch_ops.tag_compile_caches(4, 0)
    assert resets == [1]
