"""Every dist_resume collective is over when it returns: gloo's worker thread owns none of its tensors.

Otherwise that thread frees a tensor's Python object later, needs the GIL for it, and aborts the process
if the interpreter is exiting by then ("terminate called without an active exception", SIGABRT, seen in CI
after a torchrun worker had printed its results; its core dump showed gloo's worker in ~AsyncWork). Real
gloo processes; timeouts nest: pg_timeout < deadline < pytest's.
"""

from __future__ import annotations

import pytest

from tests.dist import release_workers as W
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.timeout(150)
def test_library_collectives_leave_no_tensor_with_gloo(tmp_path):
    # torch alone: right after a synchronous collective, gloo's worker still owns its tensors now and then
    # (16-44% of collectives here); this is what makes the check below able to fail
    plain = run_ranks(W.plain_collectives, 2, tmp_path=tmp_path, args=(1000,), pg_timeout=30, deadline=120)
    assert sum(plain) > 0, "gloo never held a tensor after a collective: this test could not catch a regression"

    results = run_ranks(W.library_collectives, 2, tmp_path=tmp_path, args=(150,), pg_timeout=30, deadline=120)
    for rank, res in enumerate(results):
        assert all(n > 0 for n in res["given"].values()), (rank, res["given"])  # each call ran collectives
        assert res["held"] == dict.fromkeys(res["held"], 0), (rank, res)
        assert res["intact"]
