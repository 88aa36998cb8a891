"""Drop-in APIs of other libraries on top of paged-decode (``compat.flashinfer``).

Nothing here is imported by ``paged_decode`` itself; torch is imported only when a torch
tensor arrives.
"""
