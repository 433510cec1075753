//! Enums with stable kebab-case names.

use serde::{Deserialize, Serialize};

/// An enum whose variants have stable kebab-case names, shared by JSON, metrics labels and CLI
/// flags. `as_str` and `FromStr` agree with serde.
pub trait StableName: Sized + Copy + 'static {
    /// Every variant, in declaration order.
    const ALL: &'static [Self];
    /// What the enum names (used in error messages), e.g. `"execution mode"`.
    const KIND: &'static str;
    /// The stable name of this variant.
    fn as_str(self) -> &'static str;
    /// The variant with this stable name.
    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|v| v.as_str() == name)
    }
}

/// A name that is not one of an enum's stable names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} `{name}` (expected one of: {expected})")]
pub struct UnknownName {
    /// What was being parsed.
    pub kind: &'static str,
    /// The name given.
    pub name: String,
    /// The accepted names, comma separated.
    pub expected: String,
}

/// Implements [`StableName`], `Display` and `FromStr` for an enum from a table of variants and
/// their stable names (the enum's serde names must be the same strings).
///
/// ```
/// use kvc_core::{StableName, impl_stable_name};
///
/// #[derive(Debug, Clone, Copy, PartialEq)]
/// enum Color { DeepRed, Blue }
/// impl_stable_name!(Color, "color" { DeepRed => "deep-red", Blue => "blue" });
///
/// assert_eq!(Color::DeepRed.as_str(), "deep-red");
/// assert_eq!("blue".parse::<Color>().unwrap(), Color::Blue);
/// assert!("green".parse::<Color>().unwrap_err().to_string().contains("deep-red, blue"));
/// ```
#[macro_export]
macro_rules! impl_stable_name {
    ($name:ident, $kind:literal { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $crate::StableName for $name {
            const ALL: &'static [Self] = &[$($name::$variant),+];
            const KIND: &'static str = $kind;
            fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl ::core::fmt::Display for $name {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                f.write_str($crate::StableName::as_str(*self))
            }
        }

        impl ::core::str::FromStr for $name {
            type Err = $crate::UnknownName;
            fn from_str(s: &str) -> ::core::result::Result<Self, Self::Err> {
                <Self as $crate::StableName>::from_name(s).ok_or_else(|| $crate::UnknownName {
                    kind: $kind,
                    name: s.to_owned(),
                    expected: <Self as $crate::StableName>::ALL
                        .iter()
                        .map(|v| $crate::StableName::as_str(*v))
                        .collect::<::std::vec::Vec<_>>()
                        .join(", "),
                })
            }
        }
    };
}

macro_rules! stable_enum {
    (
        $(#[$meta:meta])*
        $name:ident, $kind:literal {
            $( $(#[$vmeta:meta])* $variant:ident => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub enum $name {
            $( $(#[$vmeta])* #[serde(rename = $text)] $variant, )+
        }

        impl_stable_name!($name, $kind { $( $variant => $text ),+ });
    };
}

stable_enum! {
    /// What a worker does.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    WorkerRole, "worker role" {
        /// Prefills prompts and ships their KV cache to a decode worker.
        Prefill => "prefill",
        /// Decodes; keeps sessions resident between turns; can append-prefill a few tokens.
        Decode => "decode",
        /// Prefills and decodes (a data-parallel replica, no disaggregation).
        Colocated => "colocated",
    }
}

stable_enum! {
    /// A worker's health as the router sees it.
    Health, "health" {
        /// Fresh state, answering.
        Healthy => "healthy",
        /// Its published state is older than the staleness limit; out of rotation.
        Stale => "stale",
        /// Not answering or declared down; out of rotation.
        Down => "down",
        /// Answering, but taking no new work (an operator drains it: maintenance, a scale
        /// down); out of rotation while its requests finish. The sessions it holds still
        /// leave it with their KV: it may prefill their next turn from its cache for the
        /// worker they move to ([`ExecutionMode::MigrateKv`]).
        Draining => "draining",
    }
}

impl Health {
    /// Whether a policy may send work to a worker in this state.
    pub fn is_routable(self) -> bool {
        matches!(self, Health::Healthy)
    }

    /// Whether the worker may still send a session it holds to another worker with its KV
    /// (prefill the session's turn from its cache and ship it): healthy, or draining.
    pub fn can_send_kv(self) -> bool {
        matches!(self, Health::Healthy | Health::Draining)
    }
}

stable_enum! {
    /// The path one request took through the cluster.
    ExecutionMode, "execution mode" {
        /// First turn of a session: P prefills, KV ships to D, D decodes and keeps it resident.
        Turn1Seed => "turn1-seed",
        /// The session is resident on D: D append-prefills the new tokens and decodes.
        DirectToD => "direct-to-d",
        /// Not direct (see the fall-through reason): P prefills, KV ships to D.
        Fallback => "fallback",
        /// The session is moved to another D (migration) through the P path.
        Reseed => "reseed",
        /// Colocated topology: one worker prefills (with its prefix cache) and decodes.
        Colocated => "colocated",
        /// A worker that hosts sessions serves the turn alone: it prefills what it does not
        /// hold of the prompt (more than an append: the session is not resident there, or its
        /// append is over the direct limit), decodes, and keeps the session resident. No P,
        /// no transfer.
        LocalPrefill => "local-prefill",
        /// The session moves to another D with its KV: the worker that holds it (healthy or
        /// draining, able to prefill for others) is the turn's P — its prefix cache covers
        /// the session, so it computes only the new tokens — and the new D pulls the whole
        /// KV from it. A move without it is a `reseed`: another P computes the whole context.
        MigrateKv => "migrate-kv",
    }
}

stable_enum! {
    /// Why a later turn did not go direct-to-D.
    FallThroughReason, "fall-through reason" {
        /// The router knows of no D holding this session.
        SessionNotResident => "session-not-resident",
        /// The uncached append is larger than the direct-to-D limit.
        RealLargeAppend => "real-large-append",
        /// The session was resident but its D evicted it.
        SessionEvicted => "session-evicted",
        /// The session's D refused the append (admission said no room).
        SessionCapRejected => "session-cap-rejected",
        /// The session's D is not healthy.
        DecodeUnhealthy => "decode-unhealthy",
        /// The policy moved the session to another D (migration after repeated rejects, or
        /// its D is over the hard cap).
        Migrated => "migrated",
        /// The session's D cannot append-prefill (its engine has no decode-side prefill), so
        /// no turn goes direct-to-D there.
        DirectUnsupported => "direct-unsupported",
        /// The prompt no longer extends the session's previous one: it leaves that prompt
        /// before its last blocks and keeps at most a quarter of it (the agent compacted its
        /// history), and what the session's D does not hold of it is over the direct-to-D
        /// limit. The turn is placed as a fresh seed; the stale KV is the D's to reclaim.
        Compacted => "compacted",
    }
}

stable_enum! {
    /// How a request ended.
    Outcome, "outcome" {
        /// Completed.
        Ok => "ok",
        /// The input is over the model's limit. Counted the same in every topology and never a
        /// mechanism error.
        InputTooLong => "input-too-long",
        /// The KV transfer from P to D did not finish within the transfer timeout.
        KvTransferTimeout => "kv-transfer-timeout",
        /// D ran out of KV memory for the request.
        DecodeOom => "decode-oom",
        /// Refused by admission or by the router (no capacity anywhere, load shed).
        Rejected => "rejected",
        /// A worker failed or vanished while serving the request.
        WorkerFailed => "worker-failed",
        /// A direct-to-D turn served in full, but the decode worker's prefix cache held far less
        /// of the session than the decision counted on (the session had been evicted there):
        /// the engine recomputed the prompt. The client got its answer, so it is not a
        /// mechanism error; it is counted apart so a hidden eviction shows.
        DirectCacheMiss => "direct-cache-miss",
        /// The engine refused the request as invalid: a 4xx answer other than 408 and 429
        /// (an option the engine was not started for, such as `tool_choice: "auto"` without
        /// tool calling; a malformed field; an unknown model). The client gets the engine's
        /// answer as it is. It is the client's or the deployment's error, not the serving
        /// system's: never a mechanism error, never counted against the worker's health, and
        /// it leaves the session where it was (the engine touched none of its KV).
        InvalidRequest => "invalid-request",
    }
}

impl Outcome {
    /// The one accounting rule: every outcome other than `ok`, `input-too-long`,
    /// `direct-cache-miss` and `invalid-request` is a mechanism error (something the serving
    /// system did wrong).
    pub fn is_mechanism_error(self) -> bool {
        !matches!(
            self,
            Outcome::Ok
                | Outcome::InputTooLong
                | Outcome::DirectCacheMiss
                | Outcome::InvalidRequest
        )
    }

    /// Whether the request was served (its answer reached the client): `ok`, and a
    /// `direct-cache-miss` (served, only slower than planned). Served requests are the ones
    /// latency figures are taken over.
    pub fn is_served(self) -> bool {
        matches!(self, Outcome::Ok | Outcome::DirectCacheMiss)
    }
}

stable_enum! {
    /// Where a failed request was when it failed: what it was waiting for, on which worker
    /// (the per-request `failure` of the simulator's records).
    FailureStage, "failure stage" {
        /// Waiting in the decode worker's queue for room to preallocate its KV (the
        /// transfer timeout ran out there).
        DecodeRoom => "decode-room",
        /// Room preallocated on D; waiting for room to prefill on its prefill worker.
        PrefillRoom => "prefill-room",
        /// Room preallocated on D; still prefilling on P when D gave up on its KV.
        Prefill => "prefill",
        /// On the wire from P to D when D gave up on it.
        Transfer => "transfer",
        /// Sent over a (P, D) pair whose transfer session P holds for dead.
        FailedPair => "failed-pair",
        /// Retracted from its decode worker; waited past the timeout for room to come back.
        Retracted => "retracted",
        /// Retracted once more than its worker allows.
        RetractionLimit => "retraction-limit",
        /// Retracted on a decode-only worker whose host pool had no room to back its KV up.
        HostPoolFull => "host-pool-full",
    }
}

stable_enum! {
    /// How the prefill worker of a P→D path is chosen (the `prefill` knob of `kvc-policy`'s
    /// policies).
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    PrefillPolicy, "prefill policy" {
        /// The next healthy prefill worker in id order, blind to D (the reference baseline).
        RoundRobin => "round-robin",
        /// The lowest joint cost of the P's in-flight transfers and the target D's queue
        /// (`kvc-policy`'s `prefill` module gives the formula).
        DHealthAware => "d-health-aware",
        /// `d-health-aware`'s cost plus the share of the prompt the P would have to compute
        /// (what its prefix cache does not hold): a re-seed or fallback goes to the P that
        /// holds the session's prefix when the loads allow.
        PrefixAware => "prefix-aware",
    }
}

stable_enum! {
    /// Which resident sessions a decode worker may evict to make room (the simulator's
    /// `--eviction` flag; `kvc-admission` turns it into planner settings).
    EvictionMode, "eviction mode" {
        /// Only idle sessions, least recently used first (the reference engine).
        IdleLru => "idle-lru",
        /// Idle, then cold sessions, then hot ones above the hard cap (`kvc-admission` tiers).
        Tiered => "tiered",
    }
}

stable_enum! {
    /// The state of the circuit breaker the router's HTTP front keeps for each worker (the
    /// `state` and `to` labels of its breaker metrics).
    BreakerState, "breaker state" {
        /// Requests flow; consecutive failures are counted.
        Closed => "closed",
        /// Out of rotation until the cool-down ends.
        Open => "open",
        /// The cool-down ended: the worker is back in rotation for one trial request (or one
        /// health check), whose result closes the breaker or opens it again.
        HalfOpen => "half-open",
    }
}

stable_enum! {
    /// What the router's admission probe of a decode worker's snapshot found (the `result`
    /// label of `kvc_router_probes_total`).
    ProbeKind, "probe result" {
        /// The snapshot is fresh and has room.
        Admit => "admit",
        /// The snapshot is fresh and has no room.
        Reject => "reject",
        /// The snapshot is stale (or was never published).
        Stale => "stale",
        /// Every read attempt overlapped a publish.
        Contended => "contended",
        /// No snapshot: answered from the last polled state.
        State => "state",
    }
}

stable_enum! {
    /// How a `CommitEvict` the router forwarded to a worker ended (the `result` label of
    /// `kvc_router_commit_evicts_total`).
    CommitKind, "commit result" {
        /// The worker made room.
        Admitted => "admitted",
        /// The worker could not make room.
        Rejected => "rejected",
        /// The worker's commit queue was full.
        Busy => "busy",
        /// The worker did not answer or failed.
        Error => "error",
    }
}

stable_enum! {
    /// Why the router's session table dropped a session (the `cause` label of
    /// `kvc_router_sessions_forgotten_total`).
    Forgotten, "forget cause" {
        /// Not seen for longer than the TTL.
        Expired => "expired",
        /// The least recently seen session when the table was over its bound.
        Evicted => "evicted",
        /// The client said the session ended (an explicit end: `DELETE` on the HTTP front's
        /// sessions endpoint, or a request marked the session's last).
        Ended => "ended",
    }
}

stable_enum! {
    /// Where the router reads a worker's state from (a metrics label and the `source` of
    /// `ListWorkers`).
    StateSource, "state source" {
        /// The worker's shared-memory snapshot file, read without an RPC.
        Snapshot => "snapshot",
        /// The worker's `kvc.v1.Worker` service, asked with `State` every poll interval.
        Service => "service",
        /// A stock engine's own signals: load and pool use scraped from its Prometheus
        /// `/metrics`, and (when configured) its KV-cache events.
        Events => "events",
    }
}

stable_enum! {
    /// The serving engine behind a worker: which names its `/metrics` uses, which P/D protocol
    /// it speaks and what it can do alone.
    #[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
    EngineKind, "engine" {
        /// vLLM (NixlConnector P/D; any instance can serve a plain request in full).
        Vllm => "vllm",
        /// SGLang (bootstrap P/D; a decode server cannot serve a request alone).
        Sglang => "sglang",
    }
}
