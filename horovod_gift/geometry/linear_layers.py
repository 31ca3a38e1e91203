"""Which modules' weights GIFT can whiten: layers whose weight gradient has the form dY^T X, X the
module's input activations (tokens x in_features).

Found by class, walking the module's class hierarchy:
- torch.nn.Linear and its subclasses: weight (out, in), y = x W^T + b;
- transformers' Conv1D (GPT-2, GPT-J's and others' attention and MLP): weight (in, out),
  y = x W + b, recognized by its qualified name, so the library never imports transformers;
- any class given to register_linear (Transformer Engine's te.Linear, a fused or quantized
  linear layer of your own): which argument of forward() holds x, which attribute the weight,
  and its layout.

A weight read by several such modules (a tied embedding and LM head: the head is an nn.Linear
whose weight is the embedding's) is whitened with the statistics of every module that reads it;
the embedding's rows live in the same input space (the hidden states), so the map stays exact
and invertible for the whole gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("out_in", "in_out")


@dataclass(frozen=True)
class LinearLayout:
    """How a linear module holds its weight and receives its input.

    input: the positional index, or the keyword name, of the activations in forward()'s call;
    weight: the attribute holding the 2-D weight;
    layout: "out_in" (nn.Linear: weight[out, in]) or "in_out" (Conv1D: weight[in, out])."""
    input: object = 0
    weight: str = "weight"
    layout: str = "out_in"

    @property
    def transposed(self):
        return self.layout == "in_out"

    def activations(self, module, args, kwargs):
        """The input activations of one forward() call."""
        if isinstance(self.input, int) and self.input < len(args):
            return args[self.input]
        if isinstance(self.input, str) and self.input in kwargs:
            return kwargs[self.input]
        raise ValueError(f"GIFT: {type(module).__name__} was registered with input="
                         f"{self.input!r}, but its forward() got no such argument "
                         f"({len(args)} positional, keywords {sorted(kwargs)}); "
                         "fix the register_linear call")

    def in_features(self, weight):
        return int(weight.shape[0] if self.transposed else weight.shape[1])


# Classes registered by the user (and the built-ins below), by class.
REGISTRY: dict[type[torch.nn.Module], LinearLayout] = {torch.nn.Linear: LinearLayout()}
# Classes known by qualified name, so their library need not be imported.
KNOWN_BY_NAME = {"transformers.pytorch_utils.Conv1D": LinearLayout(layout="in_out")}


def register_linear(module_class: type, input: int = 0, weight: str = "weight",
                    layout: str = "out_in") -> None:
    """Tell GIFT that `module_class` computes y = x W^T (+ b) (layout "out_in", W stored
    out x in like nn.Linear) or y = x W (+ b) (layout "in_out", W stored in x out), with x
    forward()'s positional argument number `input` (or its keyword argument of that name) and W
    the attribute `weight`. Subclasses are covered too. Call it before GIFT(model, ...):

        gift.register_linear(te.Linear)                  # Transformer Engine
        gift.register_linear(MyFusedLinear, input="hidden_states", layout="in_out")

    A registered module's weight gradient must be dY^T X summed over the module's calls (the
    whitening is exact and invertible for any gradient, but only then does it help)."""
    if not isinstance(module_class, type) or not issubclass(module_class, torch.nn.Module):
        raise TypeError(f"register_linear: expected an nn.Module subclass, got {module_class!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"register_linear: layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(input, (int, str)) or isinstance(input, bool):
        raise TypeError(f"register_linear: input must be an argument index or keyword name, "
                        f"got {input!r}")
    if not isinstance(weight, str):
        raise TypeError(f"register_linear: weight must be an attribute name, got {weight!r}")
    REGISTRY[module_class] = LinearLayout(input, weight, layout)


def linear_layout(module):
    """The LinearLayout of module's class (the nearest registered ancestor), or None."""
    for cls in type(module).__mro__:
        if cls in REGISTRY:
            return REGISTRY[cls]
        known = KNOWN_BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
        if known is not None:
            return known
    return None


def linear_readers(model, params):
    """{parameter name: [(module name, module, LinearLayout)]} for every weight in params (name ->
    parameter, matched by identity: a tied weight has one name, its first module's) read by a
    linear module."""
    name_of = {id(p): name for name, p in params.items()}
    readers = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        layout = linear_layout(module)
        if layout is None:
            continue
        weight = getattr(module, layout.weight, None)
        if weight is None or id(weight) not in name_of:
            continue
        name = name_of[id(weight)]
        if weight.dim() != 2:
            raise ValueError(f"GIFT: {module_name} ({type(module).__name__}) is a linear layer, "
                             f"but its {layout.weight} {name} has shape {tuple(weight.shape)}, "
                             "not 2-D")
        entries = readers.setdefault(name, [])
        if all(m is not module for _, m, _ in entries):
            entries.append((module_name, module, layout))
    return readers
