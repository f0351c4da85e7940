"""The thread governor (mtpflow.backends.native.threads): all threads on a quiet machine, one while the forwards run
far slower than their fastest (a core taken), all again after the back-off."""
import pytest
import torch

from mtpflow.backends.native import threads as T


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


class Model:  # a stand-in for the weights a forward runs (weakly referenced)
    pass


MODEL = Model()


def run(governor, seconds, rows=1, model=MODEL):
    """One forward of ``rows`` rows of ``model`` that takes ``seconds`` on the governor's count; returns that
    count."""
    n = governor.threads()
    governor.observe(model, rows, seconds, n)
    return n


def test_a_quiet_machine_keeps_every_thread(two_threads):
    g = T.ThreadGovernor(enabled=True)
    noise = [1.0, 1.3, 1.1, 1.9, 1.0, 1.2, 5.0, 1.1] * 8  # the odd slow forward among fast ones
    assert {run(g, 0.005 * x) for x in noise} == {2}
    assert g.switches == 0 and torch.get_num_threads() == 2


def test_a_taken_core_sends_the_forwards_to_one_thread_then_all_are_tried_again(two_threads):
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        assert run(g, 0.005) == 2
    # a core taken: every forward three times its fastest; the decision waits until they are half a window or more
    slow = 0
    while g.switches == 0 and slow < 2 * T.WINDOW:
        assert run(g, 0.015) == 2
        slow += 1
    assert T.WINDOW // 2 <= slow <= T.WINDOW and torch.get_num_threads() == 1
    assert [run(g, 0.007) for _ in range(T.BACKOFF)] == [1] * T.BACKOFF
    assert torch.get_num_threads() == 2 and g.threads() == 2
    # still taken: PROBE slow forwards on all threads, and back to one
    assert [run(g, 0.015) for _ in range(T.PROBE)] == [2] * T.PROBE
    assert g.switches == 2 and g.threads() == 1
    assert [run(g, 0.007) for _ in range(T.BACKOFF)] == [1] * T.BACKOFF
    # the core is back: all threads stay
    assert {run(g, 0.005) for _ in range(3 * T.WINDOW)} == {2} and g.switches == 2


def test_prefills_and_single_thread_processes_are_left_alone(two_threads):
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        run(g, 0.005, rows=T.MAX_ROWS + 1)
    for _ in range(T.WINDOW):
        run(g, 0.5, rows=T.MAX_ROWS + 1)  # a prefill chunk's time is not a decode forward's
    assert g.switches == 0
    torch.set_num_threads(1)
    one = T.ThreadGovernor(enabled=True)
    for seconds in [0.005] * T.WINDOW + [0.5] * T.WINDOW:
        assert run(one, seconds) == 1
    assert one.switches == 0


def test_off_means_torchs_count(two_threads, monkeypatch):
    monkeypatch.setenv("MTPFLOW_ADAPT_THREADS", "0")
    g = T.ThreadGovernor()
    for seconds in [0.005] * T.WINDOW + [0.5] * T.WINDOW:
        assert run(g, seconds) == 2
    assert g.switches == 0


def test_each_model_is_compared_with_its_own_forwards(two_threads):
    """A float32 model's forwards, three times an int8 model's in the same process, are not a taken core."""
    g = T.ThreadGovernor(enabled=True)
    int8, float32 = Model(), Model()
    for _ in range(T.WINDOW):
        run(g, 0.005, model=int8)
    assert {run(g, 0.015, model=float32) for _ in range(3 * T.WINDOW)} == {2} and g.switches == 0


def test_a_cheaper_kind_of_forward_is_not_the_measure_of_the_models_own(two_threads):
    """A draft through the int8 copy (or the first layers only) of the same model, a third of a full forward's time,
    does not make the full forwards look slow."""
    g = T.ThreadGovernor(enabled=True)
    for _ in range(T.WINDOW):
        g.observe(MODEL, 1, 0.005, g.threads(), kind=True)  # the draft forwards
    for _ in range(3 * T.WINDOW):
        assert g.threads() == 2
        g.observe(MODEL, 1, 0.015, 2, kind=False)  # the target's own
    assert g.switches == 0
