"""The weights of a package with several models (a generation package), stored once and shared.

AOTInductor embeds each model's weights in its own library by default, which would store and load a
1B model's 2.5 GB once per graph of a generation package (:mod:`inductor_ext.runtime.generation.export`).
Instead every model is compiled without its weights (``aot_inductor.package_constants_in_so=False``)
and the package holds them once, as the record :data:`WEIGHTS` (the tensor file format,
:mod:`inductor_ext.runtime.tensor_file`, which the C++ loop reads too) and :data:`NAMES` (line ``i``: the
space-separated names of tensor ``i``, several where the model ties weights). A runtime
(:func:`inductor_ext.runtime.export.load_models`, ``csrc/generate.cpp``) reads them onto the device once and hands the
same tensors to every model as user-managed constants (no copy; the runtime keeps them alive).
"""

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.export.pt2_archive._package import PT2ArchiveReader, PT2ArchiveWriter, _package_aoti_files

from inductor_ext.runtime.tensor_file import decode_tensors, encoded_buffer

WEIGHTS = "inductor_ext/weights"
NAMES = "inductor_ext/weight_names"


def program_weights(program: torch.export.ExportedProgram) -> tuple[list[Tensor], list[list[str]]]:
    """The program's parameters, buffers and tensor constants, each storage once, with all its names."""
    named = {**program.state_dict, **{k: v for k, v in program.constants.items() if isinstance(v, Tensor)}}
    tensors: list[Tensor] = []
    names: list[list[str]] = []
    index: dict[tuple[Any, ...], int] = {}
    for name, tensor in named.items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if key not in index:
            index[key] = len(tensors)
            tensors.append(tensor.detach())
            names.append([])
        names[index[key]].append(name)
    return tensors, names


def write_package(
    path: Path, models: dict[str, list[Any]], weights: tuple[list[Tensor], list[list[str]]] | None
) -> Path:
    """A ``.pt2`` of AOTInductor ``models`` (name → ``compile_program``'s files) and the shared ``weights``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with PT2ArchiveWriter(str(path)) as writer:
        _package_aoti_files(writer, models)
        if weights is not None:
            tensors, names = weights
            buffer = encoded_buffer(tensors)
            # from the buffer's storage: write_bytes would take a copy as bytes (2.5 GB for a 1B model); the
            # binding takes an UntypedStorage, which its type stub does not name
            storage: Any = buffer.untyped_storage()
            writer.archive_file.write_record(WEIGHTS, storage, buffer.numel())
            writer.write_string(NAMES, "\n".join(" ".join(aliases) for aliases in names))
    return path


def read_weights(path: Path, device: torch.device) -> dict[str, Tensor] | None:
    """The package's shared weights on ``device`` by name (aliases share a tensor); None if it has none."""
    reader = PT2ArchiveReader(str(path))
    if NAMES not in reader.get_file_names():
        return None
    tensors = decode_tensors(reader.read_bytes(WEIGHTS), f"{path}:{WEIGHTS}", device)
    names = reader.read_string(NAMES).split("\n")
    if len(names) != len(tensors):
        raise ValueError(f"{path}: {len(tensors)} weight tensors but {len(names)} lines of names")
    return {name: tensor for tensor, aliases in zip(tensors, names, strict=True) for name in aliases.split(" ")}


def share_weights(model: Any, weights: dict[str, Tensor]) -> None:
    """Give a model compiled without its weights the shared tensors (user-managed: not copied)."""
    needed = model.get_constant_fqns()
    missing = [name for name in needed if name not in weights]
    if missing:
        raise ValueError(f"the package's weights lack {missing[:5]} (of {len(missing)} missing)")
    model.load_constants({name: weights[name] for name in needed}, check_full_update=True, user_managed=True)
