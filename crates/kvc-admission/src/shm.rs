//! The shared-memory file: creating, mapping and viewing it as snapshot words.
//!
//! This is the only module with `unsafe` code: turning the mapping's address into references to
//! the `#[repr(C)]` word structs of [`crate::layout`]. Everything else works on those references.
#![allow(unsafe_code)]

use crate::error::AdmissionError;
use crate::layout::{self, Counters, HEADER_BYTES, Header, Region, Slot, TABLE_OFFSET, WORD_BYTES};
use crate::snapshot::{HeaderInfo, validate_header};
use memmap2::{MmapOptions, MmapRaw};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

/// A mapped snapshot file of at least `file_bytes(slots)` bytes, 8-byte aligned.
pub(crate) struct ShmMap {
    map: MmapRaw,
    slots: usize,
}

impl ShmMap {
    /// Creates the file under a temporary name next to `path`, sizes and maps it, lets `init`
    /// write the header, then renames it to `path`.
    pub(crate) fn create(
        path: &Path,
        max_sessions: usize,
        init: impl FnOnce(Region<'_>),
    ) -> Result<Self, AdmissionError> {
        let tmp = temporary_name(path);
        let io = |source| AdmissionError::Io {
            path: path.to_owned(),
            source,
        };
        let result = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)
                .map_err(io)?;
            let bytes = layout::file_bytes(max_sessions);
            file.set_len(bytes as u64).map_err(io)?;
            let map = MmapOptions::new().len(bytes).map_raw(&file).map_err(io)?;
            let shm = ShmMap::new(map, max_sessions, path)?;
            init(shm.region());
            std::fs::rename(&tmp, path).map_err(io)?;
            Ok(shm)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }

    /// Opens and maps `path` read-only and validates its header.
    pub(crate) fn open(path: &Path) -> Result<(Self, HeaderInfo), AdmissionError> {
        let io = |source| AdmissionError::Io {
            path: path.to_owned(),
            source,
        };
        let file = open_for_reading(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < TABLE_OFFSET as u64 {
            return Err(AdmissionError::Truncated {
                path: path.to_owned(),
                len,
                expected: TABLE_OFFSET as u64,
            });
        }
        let map = map_for_reading(&file).map_err(io)?;
        // First a view without table (the file holds at least header and counters) to read the
        // header, then the full view once the header says how large the table is.
        let fixed = ShmMap::new(map, 0, path)?;
        let info = validate_header(fixed.region().header, len, path)?;
        let shm = ShmMap::new(fixed.map, info.max_sessions, path)?;
        Ok((shm, info))
    }

    /// Checks alignment and length, the invariants [`region`](Self::region) relies on.
    fn new(map: MmapRaw, slots: usize, path: &Path) -> Result<Self, AdmissionError> {
        if map.as_ptr().align_offset(WORD_BYTES) != 0 {
            return Err(AdmissionError::Misaligned {
                path: path.to_owned(),
            });
        }
        let needed = layout::file_bytes(slots);
        if map.len() < needed {
            return Err(AdmissionError::Truncated {
                path: path.to_owned(),
                len: map.len() as u64,
                expected: needed as u64,
            });
        }
        Ok(ShmMap { map, slots })
    }

    /// The snapshot words of the mapping.
    #[inline]
    pub(crate) fn region(&self) -> Region<'_> {
        let base = self.map.as_ptr();
        // SAFETY: `ShmMap::new` checked that `base` is 8-byte aligned (the alignment of
        // `AtomicU64` and of the three `#[repr(C)]` structs, which consist only of `AtomicU64`
        // fields and have no padding) and that the mapping holds at least
        // `file_bytes(self.slots) = TABLE_OFFSET + slots * SLOT_BYTES` bytes, so the header
        // (bytes 0..64), the counters (64..128) and `slots` slots of 32 bytes from byte 128 are
        // in bounds, aligned and do not overlap. The mapping stays valid while `self.map` lives,
        // which outlives the returned borrow. Every field is an `AtomicU64` (an `UnsafeCell`),
        // so other processes changing the memory through their own atomic word accesses is
        // allowed behind these shared references; this process only ever accesses it through
        // them. All bit patterns are valid `u64`s. A read-only mapping is only loaded from, with
        // relaxed loads, which std allows for 8-byte atomics on 64-bit targets (32-bit targets
        // map read-write, see `map_for_reading`). If another process truncates the file,
        // accesses fault (SIGBUS); the layout contract forbids resizing a published file.
        unsafe {
            Region {
                header: &*base.cast::<Header>(),
                counters: &*base.add(HEADER_BYTES).cast::<Counters>(),
                slots: std::slice::from_raw_parts(
                    base.add(TABLE_OFFSET).cast::<Slot>(),
                    self.slots,
                ),
            }
        }
    }
}

/// `<dir>/.<name>.tmp-<pid>` next to `path`, so the final rename stays on one file system.
fn temporary_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "snapshot".to_owned());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

#[cfg(target_pointer_width = "64")]
fn open_for_reading(path: &Path) -> std::io::Result<File> {
    File::open(path)
}

#[cfg(target_pointer_width = "64")]
fn map_for_reading(file: &File) -> std::io::Result<MmapRaw> {
    MmapOptions::new().map_raw_read_only(file)
}

// Relaxed 8-byte loads are only guaranteed not to write on 64-bit targets; elsewhere the reader
// maps the file read-write (and still only loads).
#[cfg(not(target_pointer_width = "64"))]
fn open_for_reading(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().read(true).write(true).open(path)
}

#[cfg(not(target_pointer_width = "64"))]
fn map_for_reading(file: &File) -> std::io::Result<MmapRaw> {
    MmapOptions::new().map_raw(file)
}
