//! The atomics the seqlock is written against.
//!
//! Normal builds use `std`; `--cfg loom` builds use loom's model-checked atomics, so the
//! very same publish/read code runs under the model checker (over an in-memory
//! [`MemSnapshot`](crate::MemSnapshot), since loom cannot model `mmap`).

#[cfg(loom)]
pub(crate) use loom::hint::spin_loop;
#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering, fence};

#[cfg(not(loom))]
pub(crate) use std::hint::spin_loop;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering, fence};
