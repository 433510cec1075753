//! Cross-crate integration tests of kvc live in `tests/tests/`; this library is empty.
#![forbid(unsafe_code)]
