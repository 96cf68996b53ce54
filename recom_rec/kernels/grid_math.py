"""Launch-grid arithmetic on the host. Triton's ``next_power_of_2`` and ``cdiv`` are constexpr
functions whose Python calls cost ~1.5 us each (Triton 3.6): a forward or backward computing its
grid with them pays that several times a call, as host time before its kernels start."""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1), as ``triton.next_power_of_2``."""
    return 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ``b``, as ``triton.cdiv``. A symbolic ``a`` (export, dynamic
    shapes) stays symbolic: ``int()`` would specialise it to its example's value."""
    return -(-a // b)
