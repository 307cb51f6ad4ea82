"""Linear shallow-water equations on a doubly periodic 2-D domain, decomposed over MPI ranks.

    python -m autoshard.examples.shallow_water [--size 48 --steps 200 --out h.npy]
    mpirun -np 4 python -m autoshard.examples.shallow_water

The ranks form a periodic Cartesian grid (``MPI.Compute_dims``); each owns a block of the
domain plus a one-cell halo, refreshed by ``mpi.sendrecv`` with its four neighbours. The whole
time loop (stencil and halo exchanges) is one ``jax.jit``-compiled ``fori_loop``. Rank 0
gathers the final height field, compares it with an undecomposed run of the same stencil
(``jnp.pad(mode="wrap")`` in place of the halo exchange) and optionally saves it, so that
runs on 1, 2 and 4 ranks can be compared (tests/mpi/test_example.py does).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from .. import mpi

GRAVITY = 9.81  # m / s^2
DEPTH = 100.0  # mean depth H, m
CORIOLIS = 1e-4  # f, 1 / s
SPACING = 1e4  # dx = dy, m
TIME_STEP = 100.0  # s; CFL: sqrt(g H) dt / dx ~ 0.3


def initial_height(num_cells: int) -> np.ndarray:
    """A Gaussian bump of 1 m off-centre, on the global (num_cells, num_cells) grid."""
    x = (np.arange(num_cells) + 0.5) / num_cells
    d2 = (x[:, None] - 0.4) ** 2 + (x[None, :] - 0.55) ** 2
    return np.exp(-d2 / 0.01)


def step(h, u, v, fill_halo):
    """One forward-backward step; arrays carry a one-cell halo that ``fill_halo`` refreshes.

    Centred differences on a collocated grid: velocities first from the height gradient,
    then the height from the divergence of the new velocities.
    """
    def ddx(a):
        return (a[2:, 1:-1] - a[:-2, 1:-1]) / (2 * SPACING)

    def ddy(a):
        return (a[1:-1, 2:] - a[1:-1, :-2]) / (2 * SPACING)

    def interior(a):
        return a[1:-1, 1:-1]

    h = fill_halo(h)
    u_new = interior(u) + TIME_STEP * (CORIOLIS * interior(v) - GRAVITY * ddx(h))
    v_new = interior(v) - TIME_STEP * (CORIOLIS * interior(u) + GRAVITY * ddy(h))
    u = fill_halo(u.at[1:-1, 1:-1].set(u_new))
    v = fill_halo(v.at[1:-1, 1:-1].set(v_new))
    h_new = interior(h) - TIME_STEP * DEPTH * (ddx(u) + ddy(v))
    return h.at[1:-1, 1:-1].set(h_new), u, v


def halo_exchange(cart):
    """A ``fill_halo`` for one rank of the periodic Cartesian communicator ``cart``."""
    neighbours = [cart.Shift(dim, 1) for dim in range(2)]  # (lower, upper) per dim

    def fill(a):
        for dim, (lower, upper) in enumerate(neighbours):
            a = jnp.moveaxis(a, dim, 0)
            # Last interior row up, first interior row down; distinct tags per direction keep
            # messages apart when both neighbours are the same rank (or this rank itself).
            up, _ = mpi.sendrecv(a[-2], a[0], lower, upper, sendtag=2 * dim, recvtag=2 * dim,
                                 comm=cart)
            down, _ = mpi.sendrecv(a[1], a[-1], upper, lower, sendtag=2 * dim + 1,
                                   recvtag=2 * dim + 1, comm=cart)
            a = jnp.moveaxis(a.at[0].set(up).at[-1].set(down), 0, dim)
        return a

    return fill


def wrap(a):
    """The single-process ``fill_halo``: periodic padding of the global field."""
    return jnp.pad(a[1:-1, 1:-1], 1, mode="wrap")


def simulate(h0, num_steps, fill_halo):
    """Runs ``num_steps`` steps from rest from the height ``h0`` (no halo); returns h (no halo)."""
    h = jnp.pad(h0, 1)
    zeros = jnp.zeros_like(h)
    h, _, _ = jax.lax.fori_loop(0, num_steps, lambda i, s: step(*s, fill_halo), (h, zeros, zeros))
    return h[1:-1, 1:-1]


def run(num_cells: int, num_steps: int, comm=MPI.COMM_WORLD):
    """The decomposed simulation; returns the global height field on rank 0 (None elsewhere)."""
    dims = MPI.Compute_dims(comm.Get_size(), 2)
    if num_cells % dims[0] or num_cells % dims[1]:
        raise ValueError(
            f"--size ({num_cells}) must be divisible by the process grid {dims[0]} x {dims[1]}; "
            f"choose a multiple of {np.lcm(*dims)}."
        )
    cart = comm.Create_cart(dims, periods=[True, True])
    block = (num_cells // dims[0], num_cells // dims[1])
    i, j = cart.Get_coords(cart.Get_rank())
    h0 = initial_height(num_cells)[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]

    solve = jax.jit(lambda h0: simulate(h0, num_steps, halo_exchange(cart)))
    h = solve(h0).block_until_ready()
    blocks, _ = mpi.gather(h, 0, comm=cart)
    if cart.Get_rank() != 0:
        return None
    blocks = np.asarray(blocks)
    rows = []
    for a in range(dims[0]):
        ranks = [cart.Get_cart_rank([a, b]) for b in range(dims[1])]
        rows.append(np.concatenate([blocks[r] for r in ranks], axis=1))
    return np.concatenate(rows, axis=0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=48, help="grid cells per side")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None, help="save rank 0's height field (.npy)")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)

    comm = MPI.COMM_WORLD
    start = time.perf_counter()
    h = run(args.size, args.steps, comm)
    if comm.Get_rank() != 0:
        return
    elapsed = time.perf_counter() - start
    reference = np.asarray(jax.jit(lambda h0: simulate(h0, args.steps, wrap))(
        initial_height(args.size)))
    mass = initial_height(args.size).sum()
    print(f"shallow water: {args.size}x{args.size} cells on {comm.Get_size()} ranks "
          f"({' x '.join(map(str, MPI.Compute_dims(comm.Get_size(), 2)))}), {args.steps} steps "
          f"in {elapsed:.2f} s; max |h| {np.abs(h).max():.6f} m; mass drift "
          f"{abs(h.sum() - mass) / mass:.1e}; max difference from the undecomposed run "
          f"{np.abs(h - reference).max():.1e}")
    if args.out:
        np.save(args.out, h)


if __name__ == "__main__":
    main()
