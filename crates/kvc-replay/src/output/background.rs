//! A file written on a thread of its own: [`BackgroundFile`] takes bytes in 1 MiB chunks and
//! hands each to a writer thread, so the simulation's thread spends no time in the kernel
//! copying `metrics.jsonl` out (a tenth of a large streamed run's time otherwise). The bytes
//! and their order are exactly what was written; an error of the writer thread comes back
//! from the next write, or from [`BackgroundFile::finish`].

use std::io::{self, Write};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// Bytes gathered before a chunk goes to the writer thread.
const CHUNK: usize = 1 << 20;
/// Chunks in flight to the writer thread at most (the memory it can hold: 4 MiB).
const IN_FLIGHT: usize = 4;

/// A file whose writes are done by a thread of its own (see the module docs).
#[derive(Debug)]
pub(crate) struct BackgroundFile {
    buf: Vec<u8>,
    to_writer: Option<SyncSender<Vec<u8>>>,
    /// Chunks the writer is done with, to be filled again.
    spare: Receiver<Vec<u8>>,
    writer: Option<JoinHandle<io::Result<()>>>,
}

impl BackgroundFile {
    /// Starts the writer thread for `file`.
    pub(crate) fn new(mut file: std::fs::File) -> io::Result<Self> {
        let (to_writer, chunks) = sync_channel::<Vec<u8>>(IN_FLIGHT);
        let (give_back, spare) = sync_channel::<Vec<u8>>(IN_FLIGHT + 1);
        let writer = std::thread::Builder::new()
            .name("kvc-replay-writer".to_owned())
            .spawn(move || {
                for mut chunk in chunks {
                    file.write_all(&chunk)?;
                    chunk.clear();
                    let _ = give_back.try_send(chunk);
                }
                file.flush()
            })?;
        Ok(BackgroundFile {
            buf: Vec::with_capacity(CHUNK),
            to_writer: Some(to_writer),
            spare,
            writer: Some(writer),
        })
    }

    /// Hands what is gathered to the writer thread.
    fn send(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let next = self
            .spare
            .try_recv()
            .unwrap_or_else(|_| Vec::with_capacity(CHUNK));
        let chunk = std::mem::replace(&mut self.buf, next);
        let sent = match &self.to_writer {
            Some(tx) => tx.send(chunk).is_ok(),
            None => false,
        };
        if sent {
            Ok(())
        } else {
            // The writer stopped before it was told to: it failed.
            self.to_writer = None;
            Err(self.join().err().unwrap_or_else(|| {
                io::Error::other("the writer thread stopped before the end of the file")
            }))
        }
    }

    /// Waits for the writer thread to end, with its result.
    fn join(&mut self) -> io::Result<()> {
        match self.writer.take() {
            Some(w) => w
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the writer thread panicked"))),
            None => Err(io::Error::other(
                "the file was already closed after an error",
            )),
        }
    }

    /// Writes what is left and waits until every byte is in the file.
    pub(crate) fn finish(mut self) -> io::Result<()> {
        self.send()?;
        self.to_writer = None;
        self.join()
    }
}

impl Write for BackgroundFile {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    /// Hands the gathered bytes to the writer thread (they reach the file soon after; only
    /// [`BackgroundFile::finish`] waits for that).
    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

impl Drop for BackgroundFile {
    fn drop(&mut self) {
        // Unfinished (an earlier error ended the run): stop the thread, keep what it wrote.
        self.to_writer = None;
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_arrives_in_order_across_chunks() {
        let dir = std::env::temp_dir().join(format!("kvc-bg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("out.jsonl");
        let mut w = BackgroundFile::new(std::fs::File::create(&path).unwrap()).unwrap();
        let mut expected = Vec::new();
        // About 5.6 MiB in lines of different lengths: several chunks, none aligned.
        for i in 0..200_000u32 {
            let line = format!(
                "{{\"i\":{i},\"pad\":\"{}\"}}\n",
                "x".repeat((i % 37) as usize)
            );
            w.write_all(line.as_bytes()).unwrap();
            expected.extend_from_slice(line.as_bytes());
        }
        w.flush().unwrap();
        w.write_all(b"tail\n").unwrap();
        expected.extend_from_slice(b"tail\n");
        w.finish().unwrap();
        let got = std::fs::read(&path).unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the file differs from what was written");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failing_write_comes_back_as_an_error() {
        // A file opened read-only: the writer thread's first write fails.
        let dir = std::env::temp_dir().join(format!("kvc-bg-ro-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ro");
        std::fs::write(&path, b"").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let mut w = BackgroundFile::new(file).unwrap();
        let chunk = vec![b'a'; CHUNK];
        // The thread's error (EBADF, os error 9) surfaces from a later write, once the
        // thread has stopped, or else from finish.
        let mut error = None;
        for _ in 0..(IN_FLIGHT + 3) {
            if let Err(e) = w.write_all(&chunk) {
                error = Some(e);
                break;
            }
        }
        let error = match error {
            Some(e) => e,
            None => w.finish().unwrap_err(),
        };
        assert_eq!(error.raw_os_error(), Some(9), "{error}");
        assert_eq!(std::fs::read(&path).unwrap().len(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
