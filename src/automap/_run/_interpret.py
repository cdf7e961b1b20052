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

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._graph import Graph, TensorKind

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
    env = {leaf.tensor: value for leaf, value in zip(graph.inputs, flat_args, strict=True)}
    wanted = [leaf.tensor for leaf in graph.outputs]
    return eval_ops(graph, range(len(graph.ops)), env, wanted, constrain)


def eval_ops(
    graph: Graph,
    op_indices: Iterable[int],
    env: Mapping[int, Any],
    wanted: Sequence[int],
    constrain: Constrain | None = None,
    consts: Mapping[int, Any] | None = None,
    bind: Mapping[int, Callable[..., Any]] | None = None,
) -> list[Any]:
    """Evaluate some of `graph`'s ops (in the order given) and return the `wanted` tensors.

    `env` holds the value of every non-constant tensor the ops read from outside them;
    `consts` the CONST tensors' values (default `graph.const_values`: the pipeline runtime
    passes a mix of two captures' constants). This is `eval_graph` for a piece of a
    program: a pipeline stage's forward ops, say, with the activations it receives.
    `bind[i]`, where given, computes op i from its input values in place of its primitive
    (the pipeline runtime keeps a gradient's per-device partial sums that way).
    """
    if len(graph.eqns) != len(graph.ops):
        raise ValueError("graph has no eqns: it was not made by automap.capture")
    ops = list(op_indices)
    values: dict[int, Any] = dict(graph.const_values if consts is None else consts)
    values.update(env)
    keep = set(wanted)
    last_use: dict[int, int] = {}
    for k, i in enumerate(ops):
        for t in graph.ops[i].inputs:
            last_use[t] = k
    for k, i in enumerate(ops):
        op = graph.ops[i]
        run_op(graph, i, values.__getitem__, values, constrain, bind)
        # Drop values no later op or output needs: keeps eager (un-jitted) runs lean.
        for t in op.inputs:
            if (
                last_use[t] == k
                and t not in keep
                and graph.tensors[t].kind is TensorKind.INTERMEDIATE
            ):
                values.pop(t, None)
    # A literal returned as is would leave as a jaxpr literal type, not an array.
    return [
        jnp.asarray(values[t]) if graph.tensors[t].kind is TensorKind.CONST else values[t]
        for t in wanted
    ]


def run_op(
    graph: Graph,
    i: int,
    read: Callable[[int], Any],
    into: dict[int, Any],
    constrain: Constrain | None = None,
    bind: Mapping[int, Callable[..., Any]] | None = None,
) -> None:
    """Run op i on the values `read` gives its inputs and store its (constrained) outputs
    in `into`; `bind[i]`, where given, computes it in place of its primitive."""
    op, eqn = graph.ops[i], graph.eqns[i]
    invals = [read(t) for t in op.inputs]
    if bind is not None and i in bind:
        outs = bind[i](*invals)
    else:
        outs = eqn.primitive.bind(*invals, **eqn.params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    for t, v in zip(op.outputs, outs, strict=True):
        into[t] = constrain(t, v) if constrain is not None else v


def run_graph(graph: Graph, *args: Any, constrain: Constrain | None = None) -> Any:
    """`eval_graph` on the step's own (pytree) arguments, returning its output pytree."""
    flat = jax.tree_util.tree_leaves(args)
    return graph.out_tree.unflatten(eval_graph(graph, flat, constrain))
