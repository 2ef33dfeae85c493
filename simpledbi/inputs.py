"""A client's inputs: its max_shapes and dtypes (as given, or as the model declares them), and the
checks every call's inputs pass before anything is sent (TypeError / ValueError naming what was
expected and what came). A part of :class:`simpledbi.client.SharedModel`, in a module of its own."""
from __future__ import annotations

import math
import os
import sys
from typing import Tuple

import numpy as np

from .layout import DATA_OFFSET, MAX_IO, MAX_NDIM, ControlBlock, code_dtype, dtype_code


def _normalize_shapes(max_shape) -> Tuple[Tuple[int, ...], ...]:
    def is_dim(d) -> bool:
        return isinstance(d, (int, np.integer)) and not isinstance(d, bool)

    if isinstance(max_shape, (tuple, list)) and max_shape and all(is_dim(d) for d in max_shape):
        max_shape = [max_shape]
    if not isinstance(max_shape, (tuple, list)) or not max_shape or not all(
            isinstance(s, (tuple, list)) and all(is_dim(d) for d in s) for s in max_shape):
        raise TypeError("max_shape: expected a shape tuple such as (1, 3, 224, 224), or a list of "
                        f"them for several inputs, got {max_shape!r}")
    shapes = tuple(tuple(int(d) for d in s) for s in max_shape)
    if len(shapes) > MAX_IO:
        raise ValueError(f"max_shape: expected at most {MAX_IO} inputs, got {len(shapes)}")
    for s in shapes:
        if not 1 <= len(s) <= MAX_NDIM + 1 or any(d < 1 for d in s):
            raise ValueError(f"max_shape: expected (rows, *item_shape) with 1..{MAX_NDIM + 1} "
                             f"positive dims, got {s}")
    return shapes


def _client_inputs(model: str, ctl: ControlBlock, max_shape, dtype):
    """This client's (max_shapes, dtypes, input names, required names): as given, else as the model declares
    them in its control block (rows: its max_batch_size; dtype: float32 where undeclared; no names where it
    declares none, or not yet). A dtype that contradicts the declared one is refused here."""
    names, shapes, decl_dtypes, required = ctl.declared()
    decl_dtypes, max_batch = tuple(map(np.dtype, decl_dtypes)), int(ctl.hdr["max_batch"])
    if max_shape is None:
        if not shapes:
            raise TypeError(f"SharedModel({model!r}): expected max_shape=(rows, *item_shape), since the "
                            f"model declares no input shapes (or declare input_shapes in its ModelConfig)")
        max_shapes = tuple((max_batch, *s) for s in shapes)
    else:
        max_shapes = _normalize_shapes(max_shape)
    n_in = len(max_shapes)
    if dtype is None:
        dtypes = list(decl_dtypes[:n_in]) + ["float32"] * (n_in - len(decl_dtypes))
    elif isinstance(dtype, (list, tuple)):
        dtypes = list(dtype)
        if len(dtypes) != n_in:
            raise ValueError(f"dtype: expected {n_in} dtypes (one per input), got {len(dtypes)}")
    else:
        dtypes = [dtype] * n_in
    dtypes = [code_dtype(dtype_code(d)) for d in dtypes]
    for k, (got, want) in enumerate(zip(dtypes, decl_dtypes)):
        if got != want:
            label = repr(names[k]) if k < len(names) else k
            raise TypeError(f"dtype: input {label}: model {model!r} declares {want}, got {got}")
    _check_slot_size(max_shapes, dtypes)
    if any(s[0] != max_shapes[0][0] for s in max_shapes):
        raise ValueError(f"max_shape: every input needs the same row count, got {[s[0] for s in max_shapes]}")
    if max_shapes[0][0] > max_batch:
        raise ValueError(f"max_shape has {max_shapes[0][0]} rows but model {model!r} has "
                         f"max_batch_size={max_batch}: a request must fit in one batch")
    return max_shapes, dtypes, names, required


def _check_slot_size(max_shapes, dtypes) -> None:
    """A slot holds every input at its max_shape: refuse, up front, one larger than this
    machine's memory (a shape of 2**40 x 2**40 would otherwise fail at every call)."""
    need = DATA_OFFSET + sum(math.prod(s) * dt.itemsize for s, dt in zip(max_shapes, dtypes))
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        memory = 2**48
    if need > memory:
        raise ValueError(f"max_shape {list(max_shapes)} ({', '.join(map(str, dtypes))}) needs a slot of "
                         f"{need:,} bytes ({need / 2**30:,.1f} GiB), more than this machine's memory "
                         f"({memory / 2**30:,.1f} GiB): expected the largest request this client sends")


class Inputs:
    def _set_inputs(self, h) -> None:
        """This client's max_shapes, dtypes and input names (_client_inputs)."""
        self.max_shapes, self.dtypes, self.input_names, self._required = _client_inputs(
            self.name, h.ctl, *self._args)
        self._declared_items = h.ctl.declared()[1]   # the model's input_shapes, if declared
        self._fits: set = set()   # (position, shape) of inputs that fit max_shapes (_check_shape)
        self._name_index = {n: j for j, n in enumerate(self.input_names)}

    def _validate(self, inputs, named=None):
        """(arrays, as_torch, names mask, positions): the inputs checked against this client's
        max_shapes and dtypes; ``positions`` (which of them the call passes) and the mask of
        their declared names for keyword calls, (0, None) for positional ones."""
        names, positions = 0, None
        if named or (len(inputs) == 1 and isinstance(inputs[0], dict)):
            inputs, positions = self._bind(inputs, named)
            names = sum(1 << j for j in positions)
        elif len(inputs) != len(self.max_shapes):
            raise TypeError(f"model {self.name!r}: expected {len(self.max_shapes)} input(s) "
                            f"(one per max_shape), got {len(inputs)}")
        arrays, as_torch, rows = [], False, None
        for k, x in enumerate(inputs):
            p = k if positions is None else positions[k]
            max_s, dt = self.max_shapes[p], self.dtypes[p]
            if not isinstance(x, np.ndarray) and type(x).__module__.startswith("torch") and \
                    "torch" in sys.modules and isinstance(x, sys.modules["torch"].Tensor):  # numpy first
                if x.device.type != "cpu":
                    raise TypeError(f"input {self._label(p)}: expected a CPU tensor, got one on {x.device}")
                if x.layout != sys.modules["torch"].strided:   # (numpy() names the dtype: helper-48)
                    raise TypeError(f"input {self._label(p)}: expected a dense tensor, got a {x.layout} one "
                                    f"(call .to_dense() first)")
                if x.is_nested:   # (strided, yet numpy() raised torch's "Internal error": helper-51)
                    raise TypeError(f"input {self._label(p)}: expected a dense tensor, got a nested one "
                                    f"(pad it first: .to_padded_tensor(0))")
                if x.is_conj() or x.is_neg():   # lazy views numpy() refuses: their values, as torch reads them
                    x = x.resolve_conj().resolve_neg()
                as_torch = True
                try:
                    x = x.detach().numpy()
                except TypeError as e:
                    raise TypeError(f"input {self._label(p)}: dtype {inputs[k].dtype} has no numpy "
                                    f"equivalent, expected {dt}") from e
            elif not isinstance(x, np.ndarray):
                raise TypeError(f"input {self._label(p)}: expected a numpy array or a torch tensor, got "
                                f"{type(x).__name__}")
            if x.dtype != dt:
                raise TypeError(f"input {self._label(p)}: expected {dt}, got {x.dtype}")
            if (p, x.shape) not in self._fits:   # shapes seen before fit: checked once each
                self._check_shape(x, p, max_s)
            if rows is not None and x.shape[0] != rows:
                raise ValueError(f"input {self._label(p)}: expected {rows} rows like the first input, "
                                 f"got {x.shape[0]}")
            rows = x.shape[0]
            arrays.append(x)
        return arrays, as_torch, names, positions

    def _check_shape(self, x: np.ndarray, p: int, max_s: Tuple[int, ...]) -> None:
        """Input ``x`` at position ``p`` must fit ``max_s``; remembered in ``_fits`` once it does."""
        if x.ndim != len(max_s):
            raise ValueError(f"input {self._label(p)}: expected {len(max_s)} dimension"
                             f"{'' if len(max_s) == 1 else 's'} (rows first, "
                             f"at most {max_s}), got shape {x.shape}")
        if x.shape[0] < 1 or x.shape[0] > max_s[0]:
            raise ValueError(f"input {self._label(p)}: expected 1..{max_s[0]} rows, got {x.shape[0]} "
                             f"(shape {x.shape}, max_shape {max_s})")
        for d, (got, most) in enumerate(zip(x.shape[1:], max_s[1:]), start=1):
            if got > most or got < 1:
                raise ValueError(f"input {self._label(p)}: dimension {d} is {got}, expected 1..{most} "
                                 f"(shape {x.shape}, max_shape {max_s})")
        if len(self._fits) > 1024:
            self._fits = set()
        self._fits.add((p, x.shape))

    def _shape_note(self, request_key) -> str:
        """For a ModelError: where this request's item shapes differ from the model's declared
        input_shapes (requests may be smaller, but a model that needs those shapes fails there with
        its own words, e.g. "mat1 and mat2 shapes cannot be multiplied": helper-52)."""
        _, positions, items = request_key
        off = [f"input {self._label(p)} has item shape {item}, the model declares {self._declared_items[p]}"
               for p, item in zip(positions, items)
               if p < len(self._declared_items) and tuple(item) != tuple(self._declared_items[p])]
        return f" ({'; '.join(off)} in input_shapes)" if off else ""

    def _label(self, k: int) -> str:
        return repr(self.input_names[k]) if k < len(self.input_names) else str(k)

    def _bind(self, inputs, named) -> Tuple[list, Tuple[int, ...]]:
        """Inputs given by name (keywords, or one dict; positional ones first take the first
        declared names, as in Python) -> (inputs in declared order, their declared indices)."""
        if not named:
            named, inputs = inputs[0], ()
            if not all(isinstance(key, str) for key in named):
                raise TypeError(f"model {self.name!r}: expected a dict of input names (str) to "
                                f"arrays, got keys {list(named)!r}")
        if not self._name_index and int(self._h.ctl.hdr["spec_len"]):  # attached before they were published
            self.input_names, *_, self._required = self._h.ctl.declared()
            self._name_index = {n: j for j, n in enumerate(self.input_names)}
        index, accepted = self._name_index, ", ".join(self.input_names)
        if not index:
            raise TypeError(f"model {self.name!r} takes no inputs by name (its forward declares no "
                            f"parameter names; declare input_names in its ModelConfig): pass them "
                            f"positionally, got {', '.join(map(repr, named))}")
        if len(inputs) > len(self.input_names):
            raise TypeError(f"model {self.name!r}: expected at most {len(self.input_names)} positional "
                            f"input(s) before the keywords ({accepted}), got {len(inputs)}")
        chosen = dict(enumerate(inputs))
        for key, x in named.items():
            j = index.get(key)
            if j is None:
                raise TypeError(f"model {self.name!r} got an unexpected keyword input {key!r}; it "
                                f"accepts {accepted}")
            if j in chosen:
                raise TypeError(f"model {self.name!r} got multiple values for input {key!r}")
            chosen[j] = x
        missing = ", ".join(repr(n) for n in self._required if index[n] not in chosen)
        if missing:   # refused unsent: the forward would raise in the model process
            got = ", ".join(self.input_names[j] for j in sorted(chosen)) or "none"
            raise TypeError(f"model {self.name!r} is missing required input(s) {missing}; it takes "
                            f"{accepted}, got {got}")
        if not chosen:
            raise TypeError(f"model {self.name!r}: expected at least one input, got none")
        positions = tuple(sorted(chosen))
        if positions[-1] >= len(self.max_shapes):
            j = positions[-1]
            raise TypeError(f"input {self._label(j)}: this client's max_shape covers only the first "
                            f"{len(self.max_shapes)} input(s) ({', '.join(self.input_names[:len(self.max_shapes)])}); "
                            f"expected max_shape with a shape for each input up to {self.input_names[j]!r}")
        return [chosen[j] for j in positions], positions
