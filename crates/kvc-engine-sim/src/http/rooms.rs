//! Bootstrap rooms: the two legs of a P→D request meet by the room the router gave both;
//! the first to arrive waits (until its deadline) for the other.

use super::engine_thread::{Progress, RequestPart};
use crate::model::Micros;
use kvc_core::WorkerId;
use std::collections::{BTreeSet, HashMap};
use tokio::sync::mpsc::UnboundedSender;

/// One leg of a P→D request, waiting for the other.
pub(super) struct WaitingLeg {
    /// Trace index of the request.
    pub(super) index: usize,
    /// Which leg, on which worker.
    pub(super) part: RequestPart,
    /// The leg's handler.
    pub(super) reply: UnboundedSender<Progress>,
    /// Engine time after which the leg gives up.
    pub(super) deadline: Micros,
}

/// Two legs that met and agree: the request can start.
pub(super) struct PairedLegs {
    pub(super) prefill: WorkerId,
    pub(super) decode: WorkerId,
    pub(super) prefill_reply: UnboundedSender<Progress>,
    pub(super) decode_reply: UnboundedSender<Progress>,
}

/// What became of a leg that arrived in a room.
pub(super) enum Meeting {
    /// It is the first: it waits.
    Waiting,
    /// The other leg was there and they agree.
    Paired(PairedLegs),
    /// The other leg was there but they do not belong together (`message` says why); both
    /// legs are out of the room.
    Mismatch {
        message: String,
        replies: [UnboundedSender<Progress>; 2],
    },
}

/// The legs waiting in their rooms, with their deadlines.
#[derive(Default)]
pub(super) struct BootstrapRooms {
    waiting: HashMap<u64, WaitingLeg>,
    /// (deadline, room) of every waiting leg.
    deadlines: BTreeSet<(Micros, u64)>,
}

impl BootstrapRooms {
    /// A leg arrives in `room`: it waits there, or meets the leg already waiting.
    pub(super) fn meet(&mut self, room: u64, leg: WaitingLeg) -> Meeting {
        let Some(other) = self.waiting.remove(&room) else {
            self.deadlines.insert((leg.deadline, room));
            self.waiting.insert(room, leg);
            return Meeting::Waiting;
        };
        self.deadlines.remove(&(other.deadline, room));
        let arrived_prefill = matches!(leg.part, RequestPart::PrefillLeg { .. });
        let (prefill_leg, decode_leg) = if arrived_prefill {
            (&leg, &other)
        } else {
            (&other, &leg)
        };
        let mismatch = |message: String| Meeting::Mismatch {
            message,
            replies: [leg.reply.clone(), other.reply.clone()],
        };
        let (
            RequestPart::PrefillLeg { prefill, .. },
            RequestPart::DecodeLeg {
                decode,
                prefill: named,
                ..
            },
        ) = (prefill_leg.part, decode_leg.part)
        else {
            return mismatch(format!(
                "bootstrap room {room} was given to two workers of one role"
            ));
        };
        if other.index != leg.index {
            return mismatch(format!("bootstrap room {room} joins two different prompts"));
        }
        if named != prefill {
            return mismatch(format!(
                "bootstrap room {room}: the decode worker was pointed at worker {} but the \
                 prefill half is on worker {}",
                named.0, prefill.0
            ));
        }
        Meeting::Paired(PairedLegs {
            prefill,
            decode,
            prefill_reply: prefill_leg.reply.clone(),
            decode_reply: decode_leg.reply.clone(),
        })
    }

    /// The earliest deadline of a waiting leg.
    pub(super) fn next_deadline(&self) -> Option<Micros> {
        self.deadlines.first().map(|(t, _)| *t)
    }

    /// Takes out every leg whose deadline is at or before `now`, earliest first.
    pub(super) fn expire(&mut self, now: Micros) -> Vec<(u64, WaitingLeg)> {
        let mut expired = Vec::new();
        while let Some((t, room)) = self.deadlines.first().copied() {
            if t > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(leg) = self.waiting.remove(&room) {
                expired.push((room, leg));
            }
        }
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

    fn leg(
        index: usize,
        part: RequestPart,
        deadline: Micros,
    ) -> (WaitingLeg, UnboundedReceiver<Progress>) {
        let (reply, rx) = unbounded_channel();
        (
            WaitingLeg {
                index,
                part,
                reply,
                deadline,
            },
            rx,
        )
    }

    const P: WorkerId = WorkerId(0);
    const D: WorkerId = WorkerId(1);

    /// P's leg of `room`, from worker `P`.
    fn prefill_leg(room: u64) -> RequestPart {
        RequestPart::PrefillLeg { room, prefill: P }
    }

    /// D's leg of `room`, from worker `D`, naming `prefill` as its P.
    fn decode_leg(room: u64, prefill: WorkerId) -> RequestPart {
        RequestPart::DecodeLeg {
            room,
            decode: D,
            prefill,
        }
    }

    #[test]
    fn legs_meet_in_either_order() {
        for prefill_first in [true, false] {
            let mut rooms = BootstrapRooms::default();
            let (p, _) = leg(3, prefill_leg(9), 100);
            let (d, _) = leg(3, decode_leg(9, P), 200);
            let (first, second) = if prefill_first { (p, d) } else { (d, p) };
            assert!(matches!(rooms.meet(9, first), Meeting::Waiting));
            assert!(rooms.next_deadline().is_some());
            match rooms.meet(9, second) {
                Meeting::Paired(pair) => assert_eq!((pair.prefill, pair.decode), (P, D)),
                _ => panic!("the legs should pair"),
            }
            assert_eq!(rooms.next_deadline(), None, "a paired room is empty");
        }
    }

    #[test]
    fn legs_that_do_not_belong_together_are_refused() {
        let cases = [
            (
                (0, decode_leg(1, P)),
                (0, decode_leg(1, P)),
                "two workers of one role",
            ),
            (
                (0, decode_leg(1, P)),
                (1, prefill_leg(1)),
                "two different prompts",
            ),
            (
                (0, decode_leg(1, WorkerId(2))),
                (0, prefill_leg(1)),
                "pointed at worker 2",
            ),
        ];
        for ((first_index, first), (second_index, second), why) in cases {
            let mut rooms = BootstrapRooms::default();
            let (first, _) = leg(first_index, first, 50);
            let (second, _) = leg(second_index, second, 50);
            assert!(matches!(rooms.meet(1, first), Meeting::Waiting));
            match rooms.meet(1, second) {
                Meeting::Mismatch { message, .. } => assert!(message.contains(why), "{message}"),
                _ => panic!("{why}: the legs should not pair"),
            }
            assert_eq!(rooms.next_deadline(), None, "both legs are out of the room");
        }
    }

    #[test]
    fn a_leg_past_its_deadline_is_taken_out() {
        let mut rooms = BootstrapRooms::default();
        let (a, _) = leg(0, prefill_leg(1), 100);
        let (b, _) = leg(1, prefill_leg(2), 300);
        rooms.meet(1, a);
        rooms.meet(2, b);
        assert_eq!(rooms.next_deadline(), Some(100));
        assert!(rooms.expire(99).is_empty());
        let expired: Vec<u64> = rooms
            .expire(100)
            .into_iter()
            .map(|(room, _)| room)
            .collect();
        assert_eq!(expired, vec![1]);
        assert_eq!(rooms.next_deadline(), Some(300));
    }
}
