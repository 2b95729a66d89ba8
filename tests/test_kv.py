"""`kv.BeamKV`: the beams' k and v side by side in one buffer (one write a decode step, one
gather a reorder), double-buffered."""

from __future__ import annotations

import torch

from boundgen.kv import BeamKV


def test_k_and_v_are_halves_of_one_buffer_and_a_reorder_moves_both():
    beams = BeamKV(2, 3, 4, 2, 8, torch.float32, "cpu")
    assert beams.kv.shape == (2, 3, 4, 2, 2, 8)
    assert beams.k.shape == beams.v.shape == (2, 3, 4, 2, 8)
    for n in range(3):  # beam n's slots hold n (k) and -n (v)
        beams.kv[:, n, :, 0] = n
        beams.kv[:, n, :, 1] = -n
    assert beams.k.data_ptr() == beams.kv.data_ptr()  # views: a write to kv is a write to k
    assert torch.equal(beams.v[:, 2], torch.full((2, 4, 2, 8), -2.0))
    buffers = {beams.kv.data_ptr(), beams._spare.data_ptr()}
    beams.reorder(torch.tensor([2, 2, 0]))  # beams 0 and 1 continue beam 2, beam 2 continues 0
    assert [int(beams.k[0, n, 0, 0, 0]) for n in range(3)] == [2, 2, 0]
    assert [int(beams.v[1, n, 3, 1, 7]) for n in range(3)] == [-2, -2, 0]
    beams.reorder(torch.tensor([2, 0, 1]))
    assert [int(beams.k[1, n, 2, 0, 3]) for n in range(3)] == [0, 2, 2]
    assert {beams.kv.data_ptr(), beams._spare.data_ptr()} == buffers  # no new allocation
