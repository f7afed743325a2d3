"""The safetensors dtype table: name -> bit width and torch dtype. Pure data, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "DType"]


@dataclass(frozen=True)
class DType:
    """One safetensors dtype: its name, bit width and the torch dtype that holds it."""

    name: str
    """The safetensors name, e.g. ``"BF16"``."""
    bits: int
    """Bits per element (4 and 6 for the packed sub-byte types)."""
    torch_name: str | None
    """Attribute of ``torch`` holding the matching dtype, or ``None`` where torch has none."""
    packed: int = 1
    """Values of this dtype per element of the torch dtype: 2 for F4, which torch holds as
    ``float4_e2m1fn_x2`` (two 4-bit values a byte), so the last dimension is halved."""

    @property
    def torch(self) -> torch.dtype | None:
        import torch  # here, not at import: reading and validating headers needs no torch

        return getattr(torch, self.torch_name, None) if self.torch_name else None

    def torch_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of the torch tensor holding ``shape`` values of this dtype (as the
        safetensors library maps it), or ``None`` where torch cannot hold it (an F4 tensor whose
        last dimension is odd, or a scalar, cannot be cut into whole packed elements)."""
        if self.packed == 1:
            return shape
        if not shape or shape[-1] % self.packed:
            return None
        return (*shape[:-1], shape[-1] // self.packed)

    def nbytes(self, numel: int) -> int | None:
        """Bytes taken by ``numel`` elements, or ``None`` if they do not fill whole bytes."""
        bits = numel * self.bits
        return bits // 8 if bits % 8 == 0 else None


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 8, "bool"),
        DType("U8", 8, "uint8"),
        DType("I8", 8, "int8"),
        DType("F8_E5M2", 8, "float8_e5m2"),
        DType("F8_E4M3", 8, "float8_e4m3fn"),
        DType("F8_E4M3FNUZ", 8, "float8_e4m3fnuz"),
        DType("F8_E5M2FNUZ", 8, "float8_e5m2fnuz"),
        DType("F8_E8M0", 8, "float8_e8m0fnu"),
        DType("I16", 16, "int16"),
        DType("U16", 16, "uint16"),
        DType("F16", 16, "float16"),
        DType("BF16", 16, "bfloat16"),
        DType("I32", 32, "int32"),
        DType("U32", 32, "uint32"),
        DType("F32", 32, "float32"),
        DType("F64", 64, "float64"),
        DType("I64", 64, "int64"),
        DType("U64", 64, "uint64"),
        DType("C64", 64, "complex64"),
        # Packed sub-byte floats. F4: two values per byte, torch's float4_e2m1fn_x2 (2.8+).
        # F6: valid in the format, no torch dtype holds them.
        DType("F4", 4, "float4_e2m1fn_x2", packed=2),
        DType("F6_E2M3", 6, None),
        DType("F6_E3M2", 6, None),
    )
}
