"""The transducer joint and loss in plain PyTorch: the CPU path, the float64 path and the specification
the CUDA kernels (``csrc/``) follow.

Layouts. A *padded* joint output or loss input is ``[B, T, U, H]`` (``[B, T, U, V]``); row ``(b, t, u)``
is valid when ``t < f_len[b]`` and ``u < g_len[b]`` (the loss: ``u <= y_len[b]``). A *packed* one is
``[N, H]``: the valid rows only, batch by batch, ``t`` major, ``u`` minor, batch ``b`` starting at row
``batch_offset[b - 1]`` (0 for ``b = 0``), ``batch_offset = cumsum(f_len * g_len)``.

The values of the lengths, offsets and labels are checked here (this path reads them anyway); the
CUDA kernels cannot check them without a host synchronisation and clamp them to the tensors' extents
instead, so that memory stays in bounds.
"""

from __future__ import annotations

import math

import torch

DONT_CARE = -1.0  # what the padded joint output holds outside the valid rows (upstream's value)
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32/float16/bfloat16, float64 for float64: accumulation and alpha/beta."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# lengths and layouts ---------------------------------------------------------------------------


def _check_range(op: str, name: str, values: torch.Tensor, low: int, high: int) -> None:
    if values.numel() and (int(values.min()) < low or int(values.max()) > high):
        raise ValueError(
            f"{op}: {name} must lie in [{low}, {high}], got values in [{int(values.min())}, {int(values.max())}]"
        )


def valid_rows(lengths_t: torch.Tensor, lengths_u: torch.Tensor, T: int, U: int) -> torch.Tensor:
    """``[B, T, U]`` bool: ``t < lengths_t[b]`` and ``u < lengths_u[b]``."""
    device = lengths_t.device
    t_ok = torch.arange(T, device=device)[None, :, None] < lengths_t.long()[:, None, None]
    u_ok = torch.arange(U, device=device)[None, None, :] < lengths_u.long()[:, None, None]
    return t_ok & u_ok


def check_packing(op: str, batch_offset: torch.Tensor, rows_per_batch: torch.Tensor, rows: int, rows_name: str) -> None:
    """The packed layout's offsets are the running sum of the rows per batch, ending at ``rows``."""
    expected = torch.cumsum(rows_per_batch.long(), 0)
    if not torch.equal(batch_offset.long().cpu(), expected.cpu()):
        raise ValueError(
            f"{op}: batch_offset must be the running sum of the rows per batch {expected.tolist()}, "
            f"got {batch_offset.tolist()}"
        )
    total = int(expected[-1]) if expected.numel() else 0
    if total != rows:
        raise ValueError(f"{op}: {rows_name} is {rows} but the batch has {total} valid rows")


# the dropout mask ------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for 32-bit x in int64 without overflowing: c in two 16-bit halves."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32): xor-shift, multiply, xor-shift, multiply, xor-shift."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    return int(_mix32(torch.tensor(x & _M32, dtype=torch.int64)))


def dropout_key(seed: int) -> int:
    """The 32-bit key of a 64-bit seed (the CUDA kernel derives it the same way)."""
    return _mix32_int((seed & _M32) ^ _mix32_int(((seed >> 32) & _M32) ^ _GOLDEN))


def keep_threshold(dropout_prob: float) -> int:
    """Element ``e`` is kept when its 32-bit hash is below this: ``floor((1 - p) * 2^32)``."""
    return math.floor((1.0 - dropout_prob) * 4294967296.0)


def dropout_keep(numel: int, seed: int, dropout_prob: float, device) -> torch.Tensor:
    """Whether each of ``numel`` elements (by flat index into the output) survives dropout:
    ``hash(lo32(e) ^ hash(hi32(e) ^ key(seed))) < keep_threshold(p)``. The same on every device."""
    e = torch.arange(numel, dtype=torch.int64, device=device)
    inner = _mix32((e >> 32) ^ dropout_key(seed))
    return _mix32((e & _M32) ^ inner) < keep_threshold(dropout_prob)


def dropout_scale(dropout_prob: float) -> float:
    return 1.0 / (1.0 - dropout_prob) if dropout_prob < 1.0 else 0.0


# joint -----------------------------------------------------------------------------------------


def joint_forward(op, f, g, f_len, g_len, batch_offset, packed_batch, relu, dropout_prob, seed):
    """``(out, mask)``: ``out[b, t, u] = f[b, t] + g[b, u]`` in float32 (float64), then ReLU and dropout
    when asked, rounded once to f's dtype; ``mask`` (uint8) is 1 where the value was kept."""
    T = f.shape[1]
    U = g.shape[1]
    _check_range(op, "f_len", f_len, 0, T)
    _check_range(op, "g_len", g_len, 0, U)
    valid = valid_rows(f_len, g_len, T, U)
    if seed is None:
        # torch adds (and compares) 16-bit tensors in float32 and rounds once: the float32 math, in
        # f's dtype (no float32 copy of the output, which took the CPU path 3x torch's time in bfloat16)
        h = f[:, :, None, :] + g[:, None, :, :]
    else:  # the dropout scale is one more float32 product before the rounding
        compute = compute_dtype(f.dtype)
        h = f.to(compute)[:, :, None, :] + g.to(compute)[:, None, :, :]
    packed = batch_offset is not None
    if packed:
        check_packing(op, batch_offset, f_len.long() * g_len.long(), packed_batch, "packed_batch")
        h = h[valid]  # [N, H]: b, t, u order, the packed layout
    masked = relu or seed is not None
    mask = None
    if masked:
        mask = h > 0 if relu else torch.ones_like(h, dtype=torch.bool)
        if seed is not None:
            mask &= dropout_keep(h.numel(), int(seed.item()), dropout_prob, h.device).view(h.shape)
            h.mul_(dropout_scale(dropout_prob))
        h.mul_(mask)
    if not packed:
        h.masked_fill_(~valid[..., None], DONT_CARE)
        if mask is not None:
            mask &= valid[..., None]
    out = h.to(f.dtype).contiguous()
    mask_out = mask.to(torch.uint8) if mask is not None else torch.empty(0, dtype=torch.uint8, device=f.device)
    return out, mask_out


def joint_backward(op, grad, mask, f_len, g_len, batch_offset, max_f_len, max_g_len, scale):
    """``(f_grad, g_grad)``: the sums over u and over t of ``grad * mask * scale`` on the valid rows."""
    B = f_len.shape[0]
    H = grad.shape[-1]
    _check_range(op, "f_len", f_len, 0, max_f_len)
    _check_range(op, "g_len", g_len, 0, max_g_len)
    valid = valid_rows(f_len, g_len, max_f_len, max_g_len)
    # The sums take float32 and round once in grad's dtype too: torch's 16-bit sums accumulate in
    # float32. Only a scale other than 1 needs a float32 copy first (the mask's 0/1 product is exact).
    d = grad if mask is None else grad * mask
    if scale != 1.0:
        d = d.to(compute_dtype(grad.dtype)) * scale
    if batch_offset is not None:
        check_packing(op, batch_offset, f_len.long() * g_len.long(), grad.shape[0], "grad's row count")
        full = d.new_zeros((B, max_f_len, max_g_len, H))
        full[valid] = d
        d = full
    else:
        d = d.masked_fill(~valid[..., None], 0.0)
    return d.sum(2).to(grad.dtype), d.sum(1).to(grad.dtype)


# loss ------------------------------------------------------------------------------------------


def loss_rows(op, x, f_len, y_len, batch_offset, max_f_len, U):
    """``[B, max_f_len, U]`` int64: the row of x holding lattice point (b, t, u), -1 where invalid."""
    B = f_len.shape[0]
    _check_range(op, "f_len", f_len, 1 if B else 0, max_f_len)
    _check_range(op, "y_len", y_len, 0, U - 1)
    valid = valid_rows(f_len, y_len.long() + 1, max_f_len, U)
    rows = torch.full((B, max_f_len, U), -1, dtype=torch.int64, device=x.device)
    count = int(valid.sum())
    if batch_offset is not None:
        check_packing(op, batch_offset, f_len.long() * (y_len.long() + 1), x.shape[0], "x's row count")
        rows[valid] = torch.arange(count, device=x.device)
    else:
        rows = torch.arange(B * max_f_len * U, device=x.device).view(B, max_f_len, U).masked_fill(~valid, -1)
    return rows, valid


def _label_rows(y_len, valid, U):
    """``[B, T, U]`` bool: the lattice points that emit a label (``u < y_len[b]``)."""
    return valid & (torch.arange(U, device=valid.device) < y_len.long()[:, None, None])


def _lattice_log_probs(op, x2, lse, rows, valid, emits, label, blank_idx, compute):
    """log p(blank) and log p(next label) at each lattice point, ``-inf`` where there is none."""
    B, T, U = rows.shape
    V = x2.shape[1]
    labels = torch.zeros(B, U, dtype=torch.int64, device=x2.device)
    labels[:, : U - 1] = label.long()
    lab = labels[:, None, :].expand(B, T, U)
    if emits.any():
        used = lab[emits]
        if int(used.min()) < 0 or int(used.max()) >= V:
            raise ValueError(
                f"{op}: label must lie in [0, {V - 1}] within y_len, "
                f"got values in [{int(used.min())}, {int(used.max())}]"
            )
    lp_blank = torch.full((B, T, U), -math.inf, dtype=compute, device=x2.device)
    lp_label = torch.full((B, T, U), -math.inf, dtype=compute, device=x2.device)
    r = rows[valid]
    lp_blank[valid] = x2[r, blank_idx].to(compute) - (lse[r] if lse is not None else 0.0)
    r = rows[emits]
    lp_label[emits] = x2[r, lab[emits]].to(compute) - (lse[r] if lse is not None else 0.0)
    return lp_blank, lp_label


def _sweep(first, step_t, step_u, T, U):
    """log-space sums over paths along anti-diagonals, vectorised over the batch and each diagonal.

    ``first`` ``[B]`` is the value at (0, 0) of the (possibly flipped) lattice; the value at (t, u)
    is ``logaddexp(v(t-1, u) + step_t(t-1, u), v(t, u-1) + step_u(t, u-1))``."""
    B = first.shape[0]
    v = torch.full((B, T, U), -math.inf, dtype=first.dtype, device=first.device)
    v[:, 0, 0] = first
    for d in range(1, T + U - 1):
        u = torch.arange(max(0, d - T + 1), min(d, U - 1) + 1, device=first.device)
        t = d - u
        from_t = torch.where(t >= 1, v[:, (t - 1).clamp(min=0), u] + step_t[:, (t - 1).clamp(min=0), u], -math.inf)
        from_u = torch.where(u >= 1, v[:, t, (u - 1).clamp(min=0)] + step_u[:, t, (u - 1).clamp(min=0)], -math.inf)
        v[:, t, u] = torch.logaddexp(from_t, from_u)
    return v


def loss_forward(op, x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, normalize):
    """``(alpha, beta, loss, lse)``; alpha and beta are 0 outside the valid lattice, ``lse`` (the
    log-sum-exp of each row of x; 0 on invalid rows) is empty unless ``normalize``."""
    compute = compute_dtype(x.dtype)
    B = f_len.shape[0]
    U = label.shape[1] + 1
    V = x.shape[-1]
    x2 = x.reshape(-1, V)
    rows, valid = loss_rows(op, x, f_len, y_len, batch_offset, max_f_len, U)
    lse = None
    if normalize:
        lse = torch.zeros(x2.shape[0], dtype=compute, device=x.device)
        r = rows[valid]
        lse[r] = torch.logsumexp(x2[r].to(compute), dim=1)
    emits = _label_rows(y_len, valid, U)
    lp_blank, lp_label = _lattice_log_probs(op, x2, lse, rows, valid, emits, label, blank_idx, compute)
    T = max_f_len
    if B == 0 or T == 0:
        empty = torch.zeros(B, T, U, dtype=compute, device=x.device)
        lse_out = lse if lse is not None else torch.empty(0, dtype=compute, device=x.device)
        return empty, empty.clone(), torch.zeros(B, dtype=x.dtype, device=x.device), lse_out
    alpha = _sweep(torch.zeros(B, dtype=compute, device=x.device), lp_blank, lp_label, T, U)
    # beta runs from each batch's own end: flip every batch so that its end lands at (0, 0).
    F = f_len.long()
    Y = y_len.long()
    bt = (F[:, None] - 1 - torch.arange(T, device=x.device)[None, :]).clamp(min=0)  # [B, T]
    bu = (Y[:, None] - torch.arange(U, device=x.device)[None, :]).clamp(min=0)  # [B, U]
    bi = torch.arange(B, device=x.device)[:, None, None]

    def flip(a):
        return a[bi, bt[:, :, None], bu[:, None, :]].masked_fill(~valid, -math.inf)

    last_blank = lp_blank[torch.arange(B, device=x.device), F - 1, Y]
    # In the flipped lattice a step back in t costs blank at the earlier (original) t, which after
    # flipping sits at the later index: shift by one so the step lands where _sweep reads it.
    fb, fl = flip(lp_blank), flip(lp_label)
    step_t = torch.full_like(fb, -math.inf)
    step_u = torch.full_like(fl, -math.inf)
    step_t[:, :-1] = fb[:, 1:]
    step_u[:, :, :-1] = fl[:, :, 1:]
    beta_flipped = _sweep(last_blank, step_t, step_u, T, U)
    beta = flip(beta_flipped)
    loss = -beta[:, 0, 0]
    zero = torch.zeros((), dtype=compute, device=x.device)
    alpha = torch.where(valid, alpha, zero)
    beta = torch.where(valid, beta, zero)
    lse_out = lse if lse is not None else torch.empty(0, dtype=compute, device=x.device)
    return alpha, beta, loss.to(x.dtype), lse_out


def loss_backward(op, x, loss_grad, alpha, beta, lse, label, f_len, y_len, batch_offset, blank_idx, fuse_softmax):
    """d(sum_b loss_grad[b] * loss[b]) / d(logits) with ``fuse_softmax`` (the log-probabilities
    are ``x - lse``, or x itself without ``lse``), else / d(log-probabilities) (only the blank and
    label entries are nonzero). Rows outside the valid lattice get 0."""
    compute = compute_dtype(x.dtype)
    B, T, U = alpha.shape
    V = x.shape[-1]
    x2 = x.reshape(-1, V)
    rows, valid = loss_rows(op, x, f_len, y_len, batch_offset, T, U)
    emits = _label_rows(y_len, valid, U)
    lp_blank, lp_label = _lattice_log_probs(op, x2, lse, rows, valid, emits, label, blank_idx, compute)
    grad = torch.zeros(x2.shape, dtype=compute, device=x.device)
    if B == 0 or T == 0 or not valid.any():
        return grad.view(x.shape).to(x.dtype)
    a = alpha.masked_fill(~valid, -math.inf)
    b_ = beta.masked_fill(~valid, -math.inf)
    norm = b_[:, 0, 0][:, None, None]
    lg = loss_grad.to(compute)[:, None, None].expand(B, T, U)
    # beta one step on in t (0 past the final blank) and in u
    beta_next_t = torch.full_like(b_, -math.inf)
    beta_next_t[:, :-1] = b_[:, 1:]
    F = f_len.long()
    Y = y_len.long()
    ar = torch.arange(B, device=x.device)
    beta_next_t[ar, F - 1, Y] = 0.0
    beta_next_u = torch.full_like(b_, -math.inf)
    beta_next_u[:, :, :-1] = b_[:, :, 1:]
    blank_term = torch.exp(a + lp_blank + beta_next_t - norm) * lg
    label_term = torch.exp(a + lp_label + beta_next_u - norm) * lg
    r = rows[valid]
    if fuse_softmax:
        logp = x2[r].to(compute)
        if lse is not None:
            logp = logp - lse[r][:, None]
        occupancy = torch.exp(a + b_ - norm)[valid] * lg[valid]
        grad[r] = torch.exp(logp) * occupancy[:, None]
    grad.index_put_((r, torch.full_like(r, blank_idx)), -blank_term[valid], accumulate=True)
    labels = torch.zeros(B, U, dtype=torch.int64, device=x.device)
    labels[:, : U - 1] = label.long()
    lab = labels[:, None, :].expand(B, T, U)[emits]
    grad.index_put_((rows[emits], lab), -label_term[emits], accumulate=True)
    return grad.view(x.shape).to(x.dtype)
