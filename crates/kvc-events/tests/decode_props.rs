//! The decoder on arbitrary input: bytes, msgpack values (biased toward the batch's own keys
//! and tags), truncated payloads. Always `Ok` or `Err`, never a panic; what decodes
//! re-encodes to the same batch and applies to an index without a panic.

use kvc_core::{BlockSize, WorkerId};
use kvc_events::{KvIndex, WorkerSpec, decode_batch, encode_batch};
use proptest::prelude::*;
use rmpv::Value;

const WORDS: &[&str] = &[
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "type",
    "ts",
    "events",
    "data_parallel_rank",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "lora_name",
    "medium",
    "session_id",
    "GPU",
    "CPU",
];

fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Boolean),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (0u64..8).prop_map(Value::from),
        any::<f64>().prop_map(Value::F64),
        any::<f32>().prop_map(Value::F32),
        ".{0,8}".prop_map(Value::from),
        prop::sample::select(WORDS).prop_map(Value::from),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Value::Binary),
        (any::<i8>(), prop::collection::vec(any::<u8>(), 0..4)).prop_map(|(t, d)| Value::Ext(t, d)),
    ];
    leaf.prop_recursive(6, 96, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec(
                (
                    prop::sample::select(WORDS).prop_map(Value::from),
                    inner.clone()
                ),
                0..8
            )
            .prop_map(Value::Map),
            prop::collection::vec((inner.clone(), inner), 0..4).prop_map(Value::Map),
        ]
    })
}

fn encode(v: &Value) -> Vec<u8> {
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, v).unwrap();
    buf
}

fn index() -> KvIndex {
    let mut idx = KvIndex::new();
    idx.add_worker(
        WorkerId(0),
        WorkerSpec {
            block_size: BlockSize::new(2).unwrap(),
            capacity_blocks: 16,
        },
    )
    .unwrap();
    idx
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1_000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn arbitrary_msgpack_never_panics_and_what_decodes_round_trips(v in value()) {
        let bytes = encode(&v);
        if let Ok(batch) = decode_batch(&bytes) {
            let mut idx = index();
            for e in &batch.events {
                let _ = idx.apply(WorkerId(0), e).unwrap();
            }
            prop_assert!(idx.indexed_blocks(WorkerId(0)) <= 16);
            if !batch.ts.is_nan() {
                prop_assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
            }
        }
    }

    #[test]
    fn a_batch_value_under_arbitrary_events_never_panics(
        events in prop::collection::vec(value(), 0..6),
        as_map in any::<bool>(),
    ) {
        let batch = if as_map {
            Value::Map(vec![
                (Value::from("ts"), Value::F64(1.0)),
                (Value::from("events"), Value::Array(events)),
            ])
        } else {
            Value::Array(vec![Value::F64(1.0), Value::Array(events)])
        };
        let _ = decode_batch(&encode(&batch));
    }
}

#[test]
fn every_truncation_of_a_fixture_is_an_error() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "msgpack") {
            let bytes = std::fs::read(&path).unwrap();
            assert!(decode_batch(&bytes).is_ok(), "{}", path.display());
            for n in 0..bytes.len() {
                assert!(
                    decode_batch(&bytes[..n]).is_err(),
                    "{} cut at {n}",
                    path.display()
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 5);
}
