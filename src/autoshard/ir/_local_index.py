"""Per-device rules of ``_local.LocalEval`` for indexing: dynamic slices and updates, gathers
and scatters by row indices (``x[:, i]``, ``take_along_axis`` and their transposes)."""

from __future__ import annotations

from jax import lax

from ._compat import bind_eqn
from ._local_kinds import P, R, is_split, one_split, split


class IndexRules:
    """Rules mixed into ``LocalEval``: each returns (output(s), kind(s)) or None."""

    def _dynamic_slice(self, e, ins, ks):
        x, kx, idx = ins[0], ks[0], ks[1:]
        if any(k != R for k in idx):
            return None
        if kx == P:
            return bind_eqn(e, ins)[0], P
        d = kx[1]
        sizes = list(e.params["slice_sizes"])
        if sizes[d] != e.invars[0].aval.shape[d]:
            return None  # a slice of the rows: its start clamps to 0 only when it takes all
        sizes[d] = x.shape[d]
        return lax.dynamic_slice(x, ins[1:], sizes), kx

    def _dynamic_update_slice(self, e, ins, ks):
        (x, upd), (kx, ku), idx = ins[:2], ks[:2], ks[2:]
        if any(k != R for k in idx):
            return None
        if P in (kx, ku):  # linear in (operand, update) together
            if is_split(kx) or is_split(ku):
                return None
            return bind_eqn(e, [self.to_p(x, kx), self.to_p(upd, ku)] + ins[2:])[0], P
        kind = one_split((kx, ku))
        if kind is None or e.invars[1].aval.shape[kind[1]] != e.invars[0].aval.shape[kind[1]]:
            return None  # an update of some rows only
        d = kind[1]
        return bind_eqn(e, [self.to_split(x, kx, d), self.to_split(upd, ku, d)] + ins[2:])[0], kind

    def _gather(self, e, ins, ks):
        (operand, indices), (ko, ki) = ins, ks
        dn = e.params["dimension_numbers"]
        if ko == P and ki == R:
            return bind_eqn(e, ins)[0], P
        if P in ks:
            return None
        nidx = len(e.invars[1].aval.shape)
        batch_out = [i for i in range(len(e.outvars[0].aval.shape)) if i not in dn.offset_dims]
        if is_split(ko) and ki == R:
            od = ko[1]
            if od in dn.operand_batching_dims:  # indices made whole in the step: slice them
                ki = split(dn.start_indices_batching_dims[
                    list(dn.operand_batching_dims).index(od)])
                indices = self.to_split(indices, R, ki[1])
            else:  # every row's whole slice along the rows: x[:, i]
                return self._gather_along_rows(e, operand, indices, od)
        if not is_split(ki) or ki[1] == nidx - 1:
            return None
        d = ki[1]
        if d in dn.start_indices_batching_dims:  # rows of the operand and of the indices pair
            od = dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(d)]
            if ko not in (R, split(od)):
                return None
            operand = self.to_split(operand, ko, od)
        elif ko != R:
            return None
        return e.primitive.bind(operand, indices, **e.params), split(batch_out[d])

    def _gather_along_rows(self, e, operand, indices, od):
        dn, params = e.params["dimension_numbers"], dict(e.params)
        sizes = list(params["slice_sizes"])
        if od in dn.collapsed_slice_dims or od in dn.start_index_map or (
                sizes[od] != e.invars[0].aval.shape[od]):
            return None
        kept = [i for i in range(len(sizes))
                if i not in dn.collapsed_slice_dims and i not in dn.operand_batching_dims]
        sizes[od] = operand.shape[od]
        params["slice_sizes"] = tuple(sizes)
        return e.primitive.bind(operand, indices, **params), split(
            dn.offset_dims[kept.index(od)])

    def _scatter_rows(self, e, ins, ks):
        """Any scatter into rows split on a dim the indices do not address: per device."""
        (operand, indices, updates), (ko, ki, ku) = ins, ks
        if ki != R or P in (ko, ku):
            return None
        dn = e.params["dimension_numbers"]
        window = [i for i in range(len(e.invars[0].aval.shape))
                  if i not in dn.inserted_window_dims and i not in dn.operand_batching_dims]
        if is_split(ko) and ko[1] in window and ko[1] not in dn.scatter_dims_to_operand_dims:
            od = ko[1]
            ud = dn.update_window_dims[window.index(od)]
        elif is_split(ku) and ku[1] in dn.update_window_dims:
            ud = ku[1]
            od = window[list(dn.update_window_dims).index(ud)]
            if od in dn.scatter_dims_to_operand_dims:
                return None
        else:
            return None
        if e.invars[2].aval.shape[ud] != e.invars[0].aval.shape[od] or (
                ko not in (R, split(od)) or ku not in (R, split(ud))):
            return None
        new = [self.to_split(operand, ko, od), indices, self.to_split(updates, ku, ud)]
        return bind_eqn(e, new)[0], split(od)

    _scatter = _scatter_mul = _scatter_min = _scatter_max = _scatter_rows

    def _scatter_add(self, e, ins, ks):
        operand, indices, updates = ins
        ko, ki, ku = ks
        dn = e.params["dimension_numbers"]
        nidx, nupd = len(e.invars[1].aval.shape), len(e.invars[2].aval.shape)
        scatter_dims = [i for i in range(nupd) if i not in dn.update_window_dims]
        if ki == R and is_split(ku) and ku[1] in scatter_dims:  # indices made whole in the step
            ki = split(scatter_dims.index(ku[1]))
            indices = self.to_split(indices, R, ki[1])
        elif ki == R and (is_split(ko) or is_split(ku)):
            return self._scatter_rows(e, ins, ks)
        if ki == R and ku in (R, P) and ko in (R, P):
            return bind_eqn(e, [self.to_p(operand, ko), indices, self.to_p(updates, ku)])[0], P
        if is_split(ki) and ku == R and ki[1] < nidx - 1:  # each device takes its rows' updates
            ku = split(scatter_dims[ki[1]])
            updates = self.to_split(updates, R, ku[1])
        if not (is_split(ki) and is_split(ku)):
            return None
        if ki[1] == nidx - 1 or scatter_dims[ki[1]] != ku[1]:
            return None
        if _paired(dn.operand_batching_dims, ko[1] if is_split(ko) else -1,
                   dn.scatter_indices_batching_dims, ki[1]) or (
                ko == R and ki[1] in dn.scatter_indices_batching_dims):
            # Row-wise scatter (the transpose of take_along_axis): each row into its own row.
            d = dn.operand_batching_dims[list(dn.scatter_indices_batching_dims).index(ki[1])]
            return bind_eqn(e, [self.to_split(operand, ko, d), indices, updates])[0], split(d)
        if is_split(ko):
            return None
        # Each device adds its own rows' updates into its copy: a partial sum of the result.
        return bind_eqn(e, [self.to_p(operand, ko), indices, updates])[0], P


def _paired(operand_dims, d_operand: int, index_dims, d_index: int) -> bool:
    """Whether operand dim ``d_operand`` and index dim ``d_index`` are one batching pair."""
    return any(a == d_operand and b == d_index for a, b in zip(
        operand_dims, index_dims, strict=True))
