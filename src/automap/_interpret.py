"""Re-run a captured program op by op, so that a plan can fix tensors inside it.

`apply` jits `eval_graph` with the plan's input and output shardings and passes a
`constrain` hook that wraps the tensors the plan fixes in `jax.lax.with_sharding_constraint`.
Because capture inlined every call, those tensors are reachable here even when the user's
step hid them inside `jax.jit`, `jax.checkpoint` or a custom-derivative function.

What inlining gives up: the step is already differentiated when it is captured, so the
custom derivative rules of inlined custom_jvp/custom_vjp calls are no longer needed;
`jax.checkpoint`'s recomputation survives as the explicit ops the backward pass already
holds, but XLA may now merge them with the forward ones (it was `prevent_cse` that kept
them apart). Results are the same; only memory and scheduling can differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._graph import Graph, TensorKind

Constrain = Callable[[int, Any], Any]


def eval_graph(
    graph: Graph, flat_args: Sequence[Any], constrain: Constrain | None = None
) -> list[Any]:
    """Evaluate `graph` on the flat input leaves, in the order of `graph.inputs`.

    Returns the flat outputs, in the order of `graph.outputs` (rebuild the pytree with
    `graph.out_tree.unflatten`). `constrain(tensor_id, value) -> value` is called on every
    op output; the identity when None. Traceable under `jax.jit`, `jax.grad` and `vmap`:
    each op is its primitive bound to its eqn's params, scan/while/cond included.
    """
    if len(flat_args) != len(graph.inputs):
        raise ValueError(f"expected {len(graph.inputs)} input leaves, got {len(flat_args)}")
    if len(graph.eqns) != len(graph.ops):
        raise ValueError("graph has no eqns: it was not made by automap.capture")
    env: list[Any] = [None] * len(graph.tensors)
    for leaf, value in zip(graph.inputs, flat_args, strict=True):
        env[leaf.tensor] = value
    for tid, value in graph.const_values.items():
        env[tid] = value
    last_use = _last_uses(graph)
    for op, eqn in zip(graph.ops, graph.eqns, strict=True):
        invals = [env[t] for t in op.inputs]
        outvals = eqn.primitive.bind(*invals, **eqn.params)
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        for tid, value in zip(op.outputs, outvals, strict=True):
            env[tid] = constrain(tid, value) if constrain is not None else value
        # Drop values no later op or output needs: keeps eager (un-jitted) runs lean.
        for t in op.inputs:
            if last_use[t] == op.index and graph.tensors[t].kind is TensorKind.INTERMEDIATE:
                env[t] = None
    # A literal returned as is would leave as a jaxpr literal type, not an array.
    return [
        jnp.asarray(env[leaf.tensor])
        if graph.tensors[leaf.tensor].kind is TensorKind.CONST
        else env[leaf.tensor]
        for leaf in graph.outputs
    ]


def _last_uses(graph: Graph) -> list[int]:
    """For each tensor, the index of the last op that reads it (len(ops) for outputs)."""
    last = [-1] * len(graph.tensors)
    for op in graph.ops:
        for t in op.inputs:
            last[t] = op.index
    for leaf in graph.outputs:
        last[leaf.tensor] = len(graph.ops)
    return last


def run_graph(graph: Graph, *args: Any, constrain: Constrain | None = None) -> Any:
    """`eval_graph` on the step's own (pytree) arguments, returning its output pytree."""
    flat = jax.tree_util.tree_leaves(args)
    return graph.out_tree.unflatten(eval_graph(graph, flat, constrain))
