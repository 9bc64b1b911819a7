"""``register_after_fork`` as in ``torch.multiprocessing._atfork``."""

from torch.multiprocessing._atfork import register_after_fork

__all__ = ["register_after_fork"]
