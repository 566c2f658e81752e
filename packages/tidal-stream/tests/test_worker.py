"""The host worker's job order: submission order, and the step's reorderable updates by their key."""

import threading

import torch

from tidal_stream.worker import HostWorker


def test_reorder_sorts_each_run_of_keyed_jobs_and_keeps_unkeyed_jobs_in_place():
    ran: list[str] = []
    gate = threading.Event()
    worker = HostWorker(torch.device("cpu"), lambda: None)
    worker.put(gate.wait)  # holds the worker so every later job is still pending at reorder()
    for name, order in [("c", 3), ("a", 1), ("barrier", None), ("d", 2), ("b", 0), ("b2", 0)]:
        worker.put(ran.append, name, order=order)
    moved = worker.reorder()
    gate.set()
    worker.join()
    worker.close()
    # a, c before the barrier (sorted among themselves); b, b2, d after it (equal keys keep their order)
    assert ran == ["a", "c", "barrier", "b", "b2", "d"]
    assert moved == 5


def test_without_reorder_jobs_run_in_submission_order():
    ran: list[int] = []
    worker = HostWorker(torch.device("cpu"), lambda: None)
    for i in (3, 1, 2):
        worker.put(ran.append, i, order=i)
    worker.join()
    worker.close()
    assert ran == [3, 1, 2]
