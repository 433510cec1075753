//! A flat open-addressing map from `u64` keys to small `Copy` values, sized by the caller.
//!
//! Linear probing over one array of (key, value) slots, key `0` meaning "empty" (a real key `0`
//! lives in a side slot), deletion by backward shift (no tombstones), load factor at most
//! 4/5. The table grows by doubling but never past the slots needed for its `limit` entries,
//! so a table filled to its limit costs `(8 + size_of::<V>()) × 5/4` bytes per entry (plus
//! one slot) — the figure `crate::index` states.

/// Slots needed to hold `n` entries at a load factor of at most 4/5.
pub(crate) fn slots_for(n: usize) -> usize {
    n + n / 4 + 1
}

#[derive(Debug, Clone)]
pub(crate) struct FlatMap<V> {
    /// (key, value); key 0: empty. One cache line per probe, key and value together.
    slots: Vec<(u64, V)>,
    len: usize,
    zero: Option<V>,
    limit: usize,
}

impl<V: Copy + Default> FlatMap<V> {
    /// An empty map that grows to at most the slots for `limit` entries (0: unlimited).
    pub(crate) fn new(limit: usize) -> Self {
        FlatMap {
            slots: Vec::new(),
            len: 0,
            zero: None,
            limit,
        }
    }

    /// Changes the growth limit (applied at the next growth).
    pub(crate) fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    pub(crate) fn len(&self) -> usize {
        self.len + usize::from(self.zero.is_some())
    }

    /// Bytes allocated for entries (capacity of the slot array).
    pub(crate) fn bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<(u64, V)>()
    }

    #[inline]
    fn home(key: u64, n: usize) -> usize {
        let mixed = key.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((u128::from(mixed) * n as u128) >> 64) as usize
    }

    #[inline]
    fn find(&self, key: u64) -> Option<usize> {
        let n = self.slots.len();
        if n == 0 {
            return None;
        }
        let mut i = Self::home(key, n);
        loop {
            let k = self.slots[i].0;
            if k == key {
                return Some(i);
            }
            if k == 0 {
                return None;
            }
            i += 1;
            if i == n {
                i = 0;
            }
        }
    }

    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        if key == 0 {
            return self.zero.as_ref();
        }
        self.find(key).map(|i| &self.slots[i].1)
    }

    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut V> {
        if key == 0 {
            return self.zero.as_mut();
        }
        self.find(key).map(|i| &mut self.slots[i].1)
    }

    /// Inserts or replaces; returns the previous value.
    pub(crate) fn insert(&mut self, key: u64, val: V) -> Option<V> {
        if key == 0 {
            return self.zero.replace(val);
        }
        if let Some(i) = self.find(key) {
            return Some(std::mem::replace(&mut self.slots[i].1, val));
        }
        if (self.len + 1) * 5 > self.slots.len() * 4 {
            self.grow();
        }
        self.place(key, val);
        self.len += 1;
        None
    }

    /// Puts a key known to be absent into the first free slot of its probe sequence.
    fn place(&mut self, key: u64, val: V) {
        let n = self.slots.len();
        let mut i = Self::home(key, n);
        while self.slots[i].0 != 0 {
            i += 1;
            if i == n {
                i = 0;
            }
        }
        self.slots[i] = (key, val);
    }

    fn grow(&mut self) {
        let needed = slots_for(self.len + 1);
        let mut slots = (self.slots.len() * 2).max(8);
        if self.limit > 0 {
            slots = slots.min(slots_for(self.limit));
        }
        let slots = slots.max(needed);
        let old = std::mem::replace(&mut self.slots, vec![(0, V::default()); slots]);
        for (k, v) in old {
            if k != 0 {
                self.place(k, v);
            }
        }
    }

    /// Removes `key`; returns its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        if key == 0 {
            return self.zero.take();
        }
        let mut i = self.find(key)?;
        let old = self.slots[i].1;
        let n = self.slots.len();
        let mut j = i;
        loop {
            j += 1;
            if j == n {
                j = 0;
            }
            let k = self.slots[j].0;
            if k == 0 {
                break;
            }
            let h = Self::home(k, n);
            // The entry at `j` may move back to the hole at `i` unless its home lies in (i, j].
            let stays = if i <= j {
                i < h && h <= j
            } else {
                i < h || h <= j
            };
            if !stays {
                self.slots[i] = self.slots[j];
                i = j;
            }
        }
        self.slots[i].0 = 0;
        self.len -= 1;
        Some(old)
    }

    /// Every entry, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &V)> + '_ {
        self.zero.iter().map(|v| (0, v)).chain(
            self.slots
                .iter()
                .filter(|(k, _)| *k != 0)
                .map(|(k, v)| (*k, v)),
        )
    }

    /// Drops every entry and frees the arrays.
    pub(crate) fn clear(&mut self) {
        self.slots = Vec::new();
        self.len = 0;
        self.zero = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        #[test]
        fn behaves_like_a_btreemap(ops in proptest::collection::vec((0u8..3, 0u64..40, any::<u32>()), 0..400)) {
            let mut m = FlatMap::<u32>::new(0);
            let mut r = BTreeMap::new();
            for (op, k, v) in ops {
                // Small keys collide in the probe sequence; a few spread ones too.
                let key = if k % 7 == 0 { k << 58 } else { k };
                match op {
                    0 => prop_assert_eq!(m.insert(key, v), r.insert(key, v)),
                    1 => prop_assert_eq!(m.remove(key), r.remove(&key)),
                    _ => prop_assert_eq!(m.get(key).copied(), r.get(&key).copied()),
                }
                prop_assert_eq!(m.len(), r.len());
            }
            let mut all: Vec<(u64, u32)> = m.iter().map(|(k, v)| (k, *v)).collect();
            all.sort();
            prop_assert_eq!(all, r.into_iter().collect::<Vec<_>>());
        }
    }

    #[test]
    fn a_full_table_costs_five_quarters_of_a_slot_per_entry() {
        let mut m = FlatMap::<u64>::new(10_000);
        for k in 1..=10_000u64 {
            m.insert(k.wrapping_mul(0x2545_F491_4F6C_DD1D), k);
        }
        assert_eq!(m.len(), 10_000);
        assert_eq!(m.bytes(), slots_for(10_000) * 16);
    }
}
