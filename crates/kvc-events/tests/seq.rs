//! Sequence tracking: next, duplicate, gap, late start, publisher restart, replay replies.

use kvc_events::{LiveAction, ReplayAction, SeqTracker};

fn at(last: u64) -> SeqTracker {
    let mut t = SeqTracker::new();
    t.applied(last);
    t
}

#[test]
fn the_first_message_applies_at_zero_and_asks_for_replay_later() {
    let t = SeqTracker::new();
    assert_eq!(t.last(), None);
    assert_eq!(t.on_live(0, true), LiveAction::Apply);
    assert_eq!(
        t.on_live(5, true),
        LiveAction::Replay {
            from: 0,
            reset: false
        }
    );
    assert_eq!(
        t.on_live(5, false),
        LiveAction::Apply,
        "no replay endpoint: start here"
    );
}

#[test]
fn next_duplicate_and_gap() {
    let t = at(7);
    assert_eq!(t.on_live(8, true), LiveAction::Apply);
    assert_eq!(t.on_live(7, true), LiveAction::Ignore);
    assert_eq!(
        t.on_live(11, true),
        LiveAction::Replay {
            from: 8,
            reset: false
        }
    );
    assert_eq!(
        t.on_live(11, false),
        LiveAction::ResetThenApply { restart: false }
    );
}

#[test]
fn a_lower_number_is_a_restarted_publisher() {
    let t = at(500);
    assert_eq!(
        t.on_live(0, true),
        LiveAction::ResetThenApply { restart: true }
    );
    assert_eq!(
        t.on_live(3, true),
        LiveAction::Replay {
            from: 0,
            reset: true
        }
    );
    assert_eq!(
        t.on_live(3, false),
        LiveAction::ResetThenApply { restart: true }
    );
    assert_eq!(
        t.on_live(499, false),
        LiveAction::ResetThenApply { restart: true }
    );
}

#[test]
fn replies_apply_in_order_skip_what_is_known_and_reset_when_history_is_gone() {
    let mut t = at(4);
    assert_eq!(t.on_replayed(3), ReplayAction::Skip);
    assert_eq!(t.on_replayed(4), ReplayAction::Skip);
    assert_eq!(t.on_replayed(5), ReplayAction::Apply);
    t.applied(5);
    assert_eq!(t.on_replayed(9), ReplayAction::ResetThenApply);
    t.reset();
    assert_eq!(t.last(), None);
    assert_eq!(t.on_replayed(0), ReplayAction::Apply);
    assert_eq!(t.on_replayed(2), ReplayAction::ResetThenApply);
}

#[test]
fn the_largest_sequence_number_does_not_overflow() {
    let t = at(u64::MAX);
    assert_eq!(t.on_live(u64::MAX, true), LiveAction::Ignore);
    assert_eq!(
        t.on_live(0, true),
        LiveAction::ResetThenApply { restart: true }
    );
    assert_eq!(t.on_replayed(u64::MAX), ReplayAction::Skip);
}
