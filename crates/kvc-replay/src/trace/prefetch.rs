//! A [`RequestSource`] read ahead on a thread of its own: [`ReadAhead`] parses the next
//! requests of a trace file while the simulation runs the ones before them (parsing is a
//! fourteenth of a large streamed run's time on one thread). The requests, their order, and
//! the error that ends a source (at the same place) are exactly the source's own; at most
//! [`BATCH`] × [`BATCHES`] requests are held ahead.

use super::stream::{Arrival, RequestSource, SourceError};
use kvc_core::BlockSize;
use std::sync::mpsc::{Receiver, sync_channel};
use std::thread::JoinHandle;

/// Requests handed over at a time.
pub const BATCH: usize = 256;
/// Batches read ahead at most.
pub const BATCHES: usize = 8;

/// Requests read by the thread, and how the source ended if it did after them.
struct Batch {
    arrivals: Vec<Arrival>,
    end: Option<Result<(), SourceError>>,
    fraction: Option<f64>,
}

/// `S` read ahead on a thread of its own (see the module docs); [`ReadAhead::into_inner`]
/// gives `S` back, with what it counted, once it is no longer needed.
pub struct ReadAhead<S> {
    block_size: BlockSize,
    batches: Option<Receiver<Batch>>,
    current: std::vec::IntoIter<Arrival>,
    end: Option<Result<(), SourceError>>,
    ended: bool,
    fraction: Option<f64>,
    reader: Option<JoinHandle<S>>,
}

impl<S> std::fmt::Debug for ReadAhead<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead")
            .field("ended", &self.ended)
            .field("fraction", &self.fraction)
            .finish_non_exhaustive()
    }
}

impl<S: RequestSource + Send + 'static> ReadAhead<S> {
    /// Starts reading `source` ahead.
    pub fn new(mut source: S) -> std::io::Result<Self> {
        let block_size = source.block_size();
        let (tx, batches) = sync_channel::<Batch>(BATCHES);
        let reader = std::thread::Builder::new()
            .name("kvc-replay-reader".to_owned())
            .spawn(move || {
                loop {
                    let mut arrivals = Vec::with_capacity(BATCH);
                    let mut end = None;
                    while arrivals.len() < BATCH {
                        match source.next_arrival() {
                            Ok(Some(a)) => arrivals.push(a),
                            Ok(None) => {
                                end = Some(Ok(()));
                                break;
                            }
                            Err(e) => {
                                end = Some(Err(e));
                                break;
                            }
                        }
                    }
                    let last = end.is_some();
                    let batch = Batch {
                        arrivals,
                        end,
                        fraction: source.fraction_read(),
                    };
                    // A closed channel: the reader of the requests is gone.
                    if tx.send(batch).is_err() || last {
                        return source;
                    }
                }
            })?;
        Ok(ReadAhead {
            block_size,
            batches: Some(batches),
            current: Vec::new().into_iter(),
            end: None,
            ended: false,
            fraction: None,
            reader: Some(reader),
        })
    }

    /// Stops reading ahead and gives the source back (as far as it was read).
    pub fn into_inner(mut self) -> S {
        self.batches = None;
        let reader = self
            .reader
            .take()
            .expect("the reader thread is joined only here");
        match reader.join() {
            Ok(source) => source,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl<S: RequestSource + Send + 'static> RequestSource for ReadAhead<S> {
    fn block_size(&self) -> BlockSize {
        self.block_size
    }

    fn next_arrival(&mut self) -> Result<Option<Arrival>, SourceError> {
        loop {
            if let Some(a) = self.current.next() {
                return Ok(Some(a));
            }
            if let Some(end) = self.end.take() {
                self.ended = true;
                return end.map(|()| None);
            }
            if self.ended {
                return Ok(None);
            }
            let batch = self.batches.as_ref().and_then(|rx| rx.recv().ok());
            let Some(batch) = batch else {
                // The thread ended without saying how the source ended: it panicked.
                self.batches = None;
                if let Some(reader) = self.reader.take()
                    && let Err(panic) = reader.join()
                {
                    std::panic::resume_unwind(panic);
                }
                unreachable!("the reader thread ends only after the source's end or a panic");
            };
            self.current = batch.arrivals.into_iter();
            self.end = batch.end;
            self.fraction = batch.fraction.or(self.fraction);
        }
    }

    fn fraction_read(&self) -> Option<f64> {
        self.fraction
    }
}

impl<S> Drop for ReadAhead<S> {
    fn drop(&mut self) {
        // Close the channel first, so a thread waiting to hand over a batch stops.
        self.batches = None;
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{LoadOptions, TraceStream};

    fn lines(n: usize) -> String {
        let mut s = String::new();
        for i in 0..n {
            s.push_str(&format!(
                "{{\"timestamp\":{},\"input_length\":1024,\"output_length\":8,\"hash_ids\":[{},{}],\"session_id\":\"s{}\"}}\n",
                i * 10,
                i,
                i + 1,
                i % 7
            ));
        }
        s
    }

    /// Per request: its index, session and the turn it follows.
    type Seen = Vec<(usize, u64, Option<usize>)>;

    fn drain(src: &mut dyn RequestSource) -> (Seen, Option<String>) {
        let mut got = Vec::new();
        loop {
            match src.next_arrival() {
                Ok(Some(a)) => got.push((a.request.index, a.request.session.0, a.after)),
                Ok(None) => return (got, None),
                Err(e) => return (got, Some(e.to_string())),
            }
        }
    }

    #[test]
    fn the_requests_and_the_end_are_the_sources_own() {
        let text = lines(3 * BATCH + 17);
        let opts = LoadOptions::default();
        let mut direct = TraceStream::new(text.as_bytes(), "t.jsonl", &opts);
        let (want, end) = drain(&mut direct);
        assert_eq!(want.len(), 3 * BATCH + 17);
        assert_eq!(end, None);
        let owned = std::io::Cursor::new(text.into_bytes());
        let mut ahead = ReadAhead::new(TraceStream::new(owned, "t.jsonl", &opts)).unwrap();
        let (got, end) = drain(&mut ahead);
        assert_eq!(got, want);
        assert_eq!(end, None);
        assert_eq!(ahead.next_arrival().unwrap().map(|a| a.request.index), None);
        let back = ahead.into_inner();
        assert_eq!(back.report().records, 3 * BATCH + 17);
    }

    #[test]
    fn an_error_comes_after_the_requests_before_it() {
        let mut text = lines(BATCH + 3);
        text.push_str("{\"timestamp\": 5, \"not a trace line\n");
        text.push_str(&lines(2));
        let opts = LoadOptions::default();
        let mut direct = TraceStream::new(text.as_bytes(), "t.jsonl", &opts);
        let (want, want_end) = drain(&mut direct);
        let owned = std::io::Cursor::new(text.into_bytes());
        let mut ahead = ReadAhead::new(TraceStream::new(owned, "t.jsonl", &opts)).unwrap();
        let (got, end) = drain(&mut ahead);
        assert_eq!(got.len(), BATCH + 3);
        assert_eq!(got, want);
        let end = end.expect("the malformed line ends the source");
        assert_eq!(Some(end.clone()), want_end);
        assert!(end.contains(&format!("t.jsonl:{}", BATCH + 4)), "{end}");
    }

    #[test]
    fn dropped_early_it_stops_its_thread() {
        let text = lines(20 * BATCH);
        let owned = std::io::Cursor::new(text.into_bytes());
        let mut ahead =
            ReadAhead::new(TraceStream::new(owned, "t.jsonl", &LoadOptions::default())).unwrap();
        assert_eq!(
            ahead.next_arrival().unwrap().map(|a| a.request.index),
            Some(0)
        );
        let back = ahead.into_inner();
        // It read no more than the batches it could hold ahead (and the one it was filling).
        assert!(back.report().records <= (BATCHES + 2) * BATCH);
        assert!(back.report().records >= BATCH);
    }
}
