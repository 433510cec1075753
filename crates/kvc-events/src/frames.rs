//! The ZeroMQ framing vLLM and SGLang use.
//!
//! - Live (PUB → SUB): `[topic, seq, payload]`, `seq` an 8-byte big-endian `u64` counting from 0.
//! - Replay request (DEALER → ROUTER): `["", start_seq]`; the ROUTER sees `[identity, "",
//!   start_seq]`.
//! - Replay replies (ROUTER → DEALER): one `["", seq, payload]` per buffered message with
//!   `seq >= start_seq`, oldest first, then the end marker `["", END_SEQ, ""]` (`seq` = −1 as a
//!   signed 8-byte big-endian integer).

use bytes::Bytes;

/// The sequence frame of the replay end marker (−1).
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// The 8-byte big-endian frame of a sequence number.
pub fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

/// A sequence number from its frame; `None` unless it is exactly 8 bytes.
pub fn parse_seq(frame: &[u8]) -> Option<u64> {
    <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes)
}

/// A live message split into (topic, seq, payload); `None` unless it has exactly three
/// frames and an 8-byte sequence frame.
pub fn split_live(frames: &[Bytes]) -> Option<(&Bytes, u64, &Bytes)> {
    match frames {
        [topic, seq, payload] => parse_seq(seq).map(|s| (topic, s, payload)),
        _ => None,
    }
}

/// One replay reply as the DEALER receives it: `Some(None)` for the end marker,
/// `Some(Some((seq, payload)))` for a message, `None` when malformed. The empty delimiter
/// frame is optional.
pub fn split_reply(frames: &[Bytes]) -> Option<Option<(u64, &Bytes)>> {
    let (seq, payload) = match frames {
        [delim, seq, payload] if delim.is_empty() => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    if seq.as_ref() == END_SEQ {
        return Some(None);
    }
    parse_seq(seq).map(|s| Some((s, payload)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_bad_shapes() {
        assert_eq!(parse_seq(&seq_frame(258)), Some(258));
        assert_eq!(seq_frame(1).as_ref(), &[0, 0, 0, 0, 0, 0, 0, 1]);
        assert_eq!(parse_seq(&[1, 2, 3]), None);
        let live = [Bytes::from("t"), seq_frame(7), Bytes::from("p")];
        assert_eq!(split_live(&live).map(|(_, s, _)| s), Some(7));
        assert!(split_live(&live[..2]).is_none());
        let end = [Bytes::new(), Bytes::copy_from_slice(&END_SEQ), Bytes::new()];
        assert_eq!(split_reply(&end), Some(None));
        let reply = [Bytes::new(), seq_frame(3), Bytes::from("p")];
        assert_eq!(split_reply(&reply).flatten().map(|(s, _)| s), Some(3));
        let bad = [Bytes::from("x"), seq_frame(3), Bytes::from("p")];
        assert_eq!(split_reply(&bad), None);
    }
}
