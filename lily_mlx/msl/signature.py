"""The kernel text MLX 0.32 generates for ``mx.fast.metal_kernel``, reproduced in Python.

``mx.fast.metal_kernel(name, input_names, output_names, source, header, ...)`` wraps ``source`` (a
function body) in a generated signature whose shape depends on the call: the input arrays decide
``device`` vs ``constant`` buffers and ``*`` vs ``&``, the text of ``source`` decides which
``<input>_shape/_strides/_ndim`` buffers and thread attributes are passed, and the template arguments
give a ``template <...>`` header plus an explicit instantiation. This module reproduces that text
exactly (checked against MLX's own output in ``tests/msl/test_signature.py``) and exposes the rules
as small functions so the simulator and the CUDA bridge share one reading of them:

- :func:`type_string` -- MLX's Metal spelling of a dtype (``float``, ``float16_t``, ``bfloat16_t``...).
- :func:`classify_inputs` / :class:`InputSpec` -- per input: address space (``constant`` for fewer
  than 8 elements, else ``device``), ``&`` for 0-d, and which of ``_shape/_strides/_ndim`` follow.
- :func:`used_thread_attributes` -- the thread attributes MLX passes (plain substring search of the
  body, alphabetical order), with their Metal types.
- :func:`format_template` / :func:`template_params` -- template instantiation text ``<float, 3, 1>``
  and the ``template <typename T, int N, bool B>`` header.
- :func:`kernel_name` -- ``custom_kernel_<name>[_<template>]_<in dtypes+kinds>_<out dtypes>``.
- :func:`parameters` -- the full ordered parameter list (:class:`Param`), buffer indices included.
- :func:`generate_source` -- the complete kernel text (without MLX's ``utils.h`` prelude).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

# Inputs with fewer elements than this go to the `constant` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute name, Metal type), in the order MLX appends them (alphabetical).
THREAD_ATTRIBUTES: Tuple[Tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}


def type_string(dtype: mx.Dtype) -> str:
    """MLX's Metal type name for ``dtype`` (``get_type_string``)."""
    try:
        return _TYPE_STRINGS[dtype]
    except KeyError:
        raise ValueError(f"no Metal type for dtype {dtype}") from None


def as_input_array(x) -> mx.array:
    """An input as MLX sees it: Python ``bool``/``int``/``float`` become 0-d ``bool``/int32/float32."""
    if isinstance(x, mx.array):
        return x
    if isinstance(x, (bool, int, float)):
        return mx.array(x)
    raise TypeError(f"[metal_kernel] inputs must be mx.array or Python scalars, got {type(x).__name__}")


@dataclass(frozen=True)
class InputSpec:
    """How one input is passed. ``space`` is ``constant`` (< 8 elements) or ``device``;
    ``scalar`` (0-d) means ``const constant T& name``; the ``*_shape/_strides/_ndim`` flags say which
    extra buffers follow it (never for 0-d inputs)."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int
    space: str
    scalar: bool
    has_shape: bool
    has_strides: bool
    has_ndim: bool

    @property
    def type(self) -> str:
        return type_string(self.dtype)

    @property
    def name_tag(self) -> str:
        """This input's part of the kernel name: ``_<type>`` plus ``s`` (0-d) or ``c`` (constant)."""
        suffix = "s" if self.scalar else ("c" if self.space == "constant" else "")
        return f"_{self.type}{suffix}"


def shape_info(source: str, input_name: str) -> Tuple[bool, bool, bool]:
    """Whether ``<name>_shape``, ``<name>_strides``, ``<name>_ndim`` occur in ``source`` (substring
    search of the body only; the header is not searched)."""
    return (
        f"{input_name}_shape" in source,
        f"{input_name}_strides" in source,
        f"{input_name}_ndim" in source,
    )


def classify_inputs(input_names: Sequence[str], inputs: Sequence, source: str) -> List[InputSpec]:
    """One :class:`InputSpec` per input (inputs may be arrays or Python scalars)."""
    if len(inputs) != len(input_names):
        raise ValueError(
            f"[metal_kernel] Expected `inputs` to have size {len(input_names)} but got size {len(inputs)}."
        )
    specs = []
    for name, x in zip(input_names, inputs):
        a = as_input_array(x)
        has_shape, has_strides, has_ndim = shape_info(source, name)
        scalar = a.ndim == 0
        specs.append(
            InputSpec(
                name=name,
                dtype=a.dtype,
                ndim=a.ndim,
                size=a.size,
                space="constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device",
                scalar=scalar,
                has_shape=has_shape and not scalar,
                has_strides=has_strides and not scalar,
                has_ndim=has_ndim and not scalar,
            )
        )
    return specs


def used_thread_attributes(source: str) -> List[Tuple[str, str]]:
    """``[(attribute, metal_type)]`` MLX passes for ``source``: each attribute whose name occurs
    anywhere in the body (comments and longer identifiers count), in alphabetical order."""
    return [(a, t) for a, t in THREAD_ATTRIBUTES if a in source]


def _template_value(value) -> Tuple[str, str]:
    """(parameter kind, instantiation text) of one template argument."""
    if isinstance(value, bool):  # before int: bool is an int in Python
        return "bool", "1" if value else "0"
    if isinstance(value, int):
        return "int", str(value)
    if isinstance(value, mx.Dtype):
        return "typename", type_string(value)
    raise TypeError(f"[metal_kernel] template argument must be a dtype, int or bool, got {type(value).__name__}")


def normalize_template(template) -> List[Tuple[str, object]]:
    """Template arguments as a list of (name, value); accepts a list of pairs or a dict."""
    if template is None:
        return []
    items = list(template.items()) if isinstance(template, dict) else list(template)
    out = []
    for item in items:
        name, value = item
        _template_value(value)  # type check
        out.append((str(name), value))
    return out


def format_template(template) -> str:
    """Instantiation text, e.g. ``<float, 3, 1, bfloat16_t>`` (bools as 1/0); "" without args."""
    args = normalize_template(template)
    if not args:
        return ""
    return "<" + ", ".join(_template_value(v)[1] for _, v in args) + ">"


def template_params(template) -> str:
    """Template header, e.g. ``template <typename T, int N, bool B>\\n``; "" without args."""
    args = normalize_template(template)
    if not args:
        return ""
    return "template <" + ", ".join(f"{_template_value(v)[0]} {n}" for n, v in args) + ">\n"


def kernel_name(name: str, template, input_specs: Sequence[InputSpec], output_dtypes: Sequence[mx.Dtype]) -> str:
    """The host name MLX gives the kernel (it is also its library name)."""
    out = "custom_kernel_" + name
    tdef = format_template(template)
    if tdef:
        out += "_" + re.sub(r"<|>|, ", "_", tdef)[:-1]
    out += "".join(s.name_tag for s in input_specs)
    out += "".join("_" + type_string(d) for d in output_dtypes)
    return out


@dataclass(frozen=True)
class Param:
    """One kernel parameter. ``kind``: input | shape | strides | ndim | output | attribute.
    ``index`` is the buffer index (None for thread attributes); ``ctype`` the element type
    (for attributes: ``uint``/``uint3``); ``space``/``ref`` as written by MLX."""

    kind: str
    name: str
    ctype: str
    index: Optional[int]
    space: str = ""
    ref: str = "*"
    input_index: Optional[int] = None  # which input a shape/strides/ndim/input param belongs to
    output_index: Optional[int] = None
    atomic: bool = False


def parameters(
    input_specs: Sequence[InputSpec],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    source: str,
    atomic_outputs: bool = False,
) -> List[Param]:
    """All parameters in MLX's order: each input then its shape/strides/ndim, outputs, attributes."""
    params: List[Param] = []
    index = 0
    for i, s in enumerate(input_specs):
        params.append(Param("input", s.name, s.type, index, s.space, "&" if s.scalar else "*", input_index=i))
        index += 1
        for flag, kind, ctype, space, ref in (
            (s.has_shape, "shape", "int", "constant", "*"),
            (s.has_strides, "strides", "int64_t", "constant", "*"),
            (s.has_ndim, "ndim", "int", "constant", "&"),
        ):
            if flag:
                params.append(Param(kind, f"{s.name}_{kind}", ctype, index, space, ref, input_index=i))
                index += 1
    for j, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        params.append(Param("output", name, type_string(dtype), index, "device", "*", output_index=j, atomic=atomic_outputs))
        index += 1
    for attr, ctype in used_thread_attributes(source):
        params.append(Param("attribute", attr, ctype, None))
    return params


def param_text(p: Param) -> str:
    """One parameter line as MLX writes it (without the trailing separator)."""
    if p.kind == "attribute":
        return f"  {p.ctype} {p.name} [[{p.name}]]"
    if p.kind == "output":
        t = f"atomic<{p.ctype}>" if p.atomic else p.ctype
        return f"  device {t}* {p.name} [[buffer({p.index})]]"
    return f"  const {p.space} {p.ctype}{p.ref} {p.name} [[buffer({p.index})]]"


def _signature_separators(params: Sequence[Param], n_inputs: int, n_outputs: int) -> List[str]:
    """The text after each parameter, reproducing MLX's rule (including its quirk: the output
    separator compares the buffer index with inputs + outputs - 1)."""
    attrs = [p for p in params if p.kind == "attribute"]
    seps = []
    for p in params:
        if p.kind == "output":
            if p.index < n_inputs + n_outputs - 1 or attrs:
                seps.append(",\n")
            else:
                seps.append(") {\n")
        elif p.kind == "attribute":
            seps.append(",\n" if p is not attrs[-1] else ") {\n")
        else:
            seps.append(",\n")
    return seps


def generate_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    template=None,
    atomic_outputs: bool = False,
    inputs: Sequence = (),
    output_dtypes: Sequence[mx.Dtype] = (),
) -> Tuple[str, str]:
    """(kernel name, kernel text) exactly as MLX 0.32 generates them (MLX prepends its ``utils.h``
    when compiling; that prelude is not part of this text)."""
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    specs = classify_inputs(input_names, inputs, source)
    kname = kernel_name(name, template, specs, output_dtypes)
    params = parameters(specs, output_names, output_dtypes, source, atomic_outputs)
    text = header + template_params(template)
    text += f"[[kernel]] void {kname}(\n"
    for p, sep in zip(params, _signature_separators(params, len(specs), len(output_names))):
        text += param_text(p) + sep
    text += source + "\n}\n"
    tdef = format_template(template)
    if tdef:
        inst = kname + tdef
        text += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({inst}) {inst};\n'
    return kname, text
