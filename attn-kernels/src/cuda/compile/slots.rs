//! [`Slots`]: values made once per key, each behind its own lock, so a slow make (an
//! NVRTC compile) holds up only the callers of that key.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// One key's place: filled by the first caller that makes its value.
type Slot<V> = Arc<Mutex<Option<V>>>;

/// Values by key, made on first use.
#[derive(Debug)]
pub(crate) struct Slots<K, V>(Mutex<HashMap<K, Slot<V>>>);

impl<K: Eq + Hash, V: Clone> Slots<K, V> {
    pub(crate) fn new() -> Self {
        Slots(Mutex::new(HashMap::new()))
    }

    fn slot(&self, key: K) -> Slot<V> {
        // The map stays whole whatever a panicking holder did (it only ever inserts).
        self.0.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_default().clone()
    }

    /// The value of `key` and whether it was there already; else `make`'s, kept. Callers
    /// of one key wait for one make; a failed make leaves the place empty.
    pub(crate) fn get_or_make<E>(&self, key: K, make: impl FnOnce() -> Result<V, E>) -> Result<(V, bool), E> {
        let slot = self.slot(key);
        let mut value = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(v) = value.as_ref() {
            return Ok((v.clone(), true));
        }
        let v = make()?;
        *value = Some(v.clone());
        Ok((v, false))
    }

    /// Keeps `value` for `key` in place of what it held.
    pub(crate) fn replace(&self, key: K, value: V) {
        *self.slot(key).lock().unwrap_or_else(PoisonError::into_inner) = Some(value);
    }
}

#[cfg(test)]
mod tests {
    use super::Slots;

    #[test]
    fn a_value_is_made_once_and_a_failed_make_keeps_nothing() {
        let slots = Slots::<u8, String>::new();
        assert_eq!(slots.get_or_make(1, || Err::<String, _>("no")), Err("no"));
        assert_eq!(slots.get_or_make(1, || Ok::<_, ()>("a".into())), Ok(("a".into(), false)));
        assert_eq!(slots.get_or_make(1, || Ok::<_, ()>("b".into())), Ok(("a".into(), true)));
        slots.replace(1, "c".into());
        assert_eq!(slots.get_or_make(1, || Ok::<_, ()>("d".into())), Ok(("c".into(), true)));
        assert_eq!(slots.get_or_make(2, || Ok::<_, ()>("e".into())), Ok(("e".into(), false)));
    }

    #[test]
    fn callers_of_one_key_wait_for_one_make() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (slots, makes) = (Slots::<u8, u8>::new(), AtomicUsize::new(0));
        let make = || {
            makes.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(50));
            Ok::<_, ()>(7)
        };
        let seen: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4).map(|_| s.spawn(|| slots.get_or_make(0, make).unwrap().1)).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(makes.load(Ordering::SeqCst), 1);
        assert_eq!(seen.iter().filter(|&&kept| !kept).count(), 1, "one caller made it: {seen:?}");
    }
}
