"""Layer 3: snapshots of a checkpoint folder in the node's shared memory (``/dev/shm``), torch-free: the store of
the memory tier, beside the object stores' ``_store`` (the tier's policy, which rank writes what and when, is
``_manager/snapshots``).

Where a folder's snapshots live and whose they are (``place``), the commit record that makes one complete
(``record``), the folder's identity every record names (``identity``: a folder deleted and made again never resumes
older snapshots), the free space a write needs and the bytes a folder holds (``space``), writing one
double-buffered (``write``; a file laid out beforehand, ``layout``, copied into slots this process keeps mapped,
``slots``, where the node's other processes map it too to copy their share), its commit after its CRC-32
(``pending``), the complete ones found and checked (``read``), and copying one to the folder (whole, or a range of
it, the CRC-32 checked), marking it copied, retiring one and removing them, the stale ones too (``persist``). Every
function is local: no collective, one node's memory. Collective use (which rank writes what, agreeing on a step)
belongs to the layers above.
"""

from .identity import IDENTITY_NAME, make_identity, read_identity
from .layout import FileLayout, Region, crc32_combine, zip_file_layout
from .pending import PendingSnapshot
from .persist import (
    check_copied,
    copy_bytes,
    mark_persisted,
    open_snapshot,
    persist_snapshot,
    release_mappings,
    remove_snapshots,
    remove_stale,
    retire_snapshot,
)
from .place import SHM_DIR_ENV, folder_key, shm_root, store_dir
from .read import newest_snapshot, snapshots
from .record import Snapshot
from .slots import attach_slot
from .space import free_bytes, held_bytes, size_estimate
from .write import begin_copy, begin_snapshot, write_snapshot

__all__ = [
    "SHM_DIR_ENV",
    "Snapshot",
    "PendingSnapshot",
    "begin_snapshot",
    "begin_copy",
    "attach_slot",
    "FileLayout",
    "Region",
    "zip_file_layout",
    "crc32_combine",
    "write_snapshot",
    "newest_snapshot",
    "snapshots",
    "mark_persisted",
    "retire_snapshot",
    "remove_stale",
    "IDENTITY_NAME",
    "read_identity",
    "make_identity",
    "persist_snapshot",
    "open_snapshot",
    "copy_bytes",
    "check_copied",
    "remove_snapshots",
    "release_mappings",
    "held_bytes",
    "free_bytes",
    "size_estimate",
    "folder_key",
    "shm_root",
    "store_dir",
]
