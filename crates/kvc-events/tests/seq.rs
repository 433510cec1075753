//! Sequence tracking: next, duplicate, gap, late start, publisher restart, replay replies,
//! live messages held or queued while a replay ran.

use kvc_events::{LiveAction, ReplayAction, SeqTracker};

/// A tracker that received and applied live messages up to `last`.
fn at(last: u64) -> SeqTracker {
    let mut t = SeqTracker::new();
    assert_eq!(t.on_live(last, false), LiveAction::Apply);
    t.applied(last);
    t
}

#[test]
fn the_first_message_applies_at_zero_and_asks_for_replay_later() {
    assert_eq!(SeqTracker::new().last(), None);
    assert_eq!(SeqTracker::new().on_live(0, true), LiveAction::Apply);
    assert_eq!(
        SeqTracker::new().on_live(5, true),
        LiveAction::Replay {
            from: 0,
            reset: false
        }
    );
    assert_eq!(
        SeqTracker::new().on_live(5, false),
        LiveAction::Apply,
        "no replay endpoint: start here"
    );
}

#[test]
fn next_duplicate_and_gap() {
    assert_eq!(at(7).on_live(8, true), LiveAction::Apply);
    assert_eq!(at(7).on_live(7, true), LiveAction::Ignore);
    assert_eq!(
        at(7).on_live(11, true),
        LiveAction::Replay {
            from: 8,
            reset: false
        }
    );
    assert_eq!(
        at(7).on_live(11, false),
        LiveAction::ResetThenApply { restart: false }
    );
}

#[test]
fn a_live_number_going_down_is_a_restarted_publisher() {
    assert_eq!(
        at(500).on_live(0, true),
        LiveAction::ResetThenApply { restart: true }
    );
    assert_eq!(
        at(500).on_live(3, true),
        LiveAction::Replay {
            from: 0,
            reset: true
        }
    );
    assert_eq!(
        at(500).on_live(3, false),
        LiveAction::ResetThenApply { restart: true }
    );
    assert_eq!(
        at(500).on_live(499, false),
        LiveAction::ResetThenApply { restart: true }
    );
}

#[test]
fn live_messages_a_replay_delivered_are_ignored_not_taken_for_a_restart() {
    let mut t = at(4);
    // 8 arrives: gap 5..=7; the replay brings 5..=10 while 9 is held.
    assert_eq!(
        t.on_live(8, true),
        LiveAction::Replay {
            from: 5,
            reset: false
        }
    );
    t.hold(9);
    for seq in 5..=10 {
        assert_eq!(t.on_replayed(seq), ReplayAction::Apply);
        t.applied(seq);
    }
    assert_eq!(t.on_held(8), LiveAction::Ignore);
    assert_eq!(t.on_held(9), LiveAction::Ignore);
    // 10 was still queued on the live socket: already applied, not a restart.
    assert_eq!(t.on_live(10, true), LiveAction::Ignore);
    assert_eq!(t.on_live(11, true), LiveAction::Apply);
    t.applied(11);
    // Now the live stream goes back: a new publisher.
    assert_eq!(
        t.on_live(2, true),
        LiveAction::Replay {
            from: 0,
            reset: true
        }
    );
}

#[test]
fn held_messages_apply_in_order_and_an_unclosed_gap_resets() {
    let mut t = at(4);
    assert_eq!(t.on_held(5), LiveAction::Apply);
    t.applied(5);
    assert_eq!(t.on_held(9), LiveAction::ResetThenApply { restart: false });
    t.reset();
    assert_eq!(
        t.on_held(9),
        LiveAction::Apply,
        "after a reset the next held message starts over"
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
    assert_eq!(at(u64::MAX).on_live(u64::MAX, true), LiveAction::Ignore);
    assert_eq!(
        at(u64::MAX).on_live(0, true),
        LiveAction::ResetThenApply { restart: true }
    );
    assert_eq!(at(u64::MAX).on_replayed(u64::MAX), ReplayAction::Skip);
}
