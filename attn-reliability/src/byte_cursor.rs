//! A cursor that turns arbitrary fuzzer bytes into small structured values (lengths,
//! flags, floats); it never fails: past the end it yields zeros.

/// Reads little pieces from a byte string, front to back.
#[derive(Debug, Clone)]
pub struct ByteCursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> ByteCursor<'a> {
    pub fn new(bytes: &'a [u8]) -> Self {
        ByteCursor { bytes, at: 0 }
    }
    /// The next byte (0 past the end).
    pub fn u8(&mut self) -> u8 {
        let b = self.bytes.get(self.at).copied().unwrap_or(0);
        self.at = self.at.saturating_add(1);
        b
    }
    /// The next 8 bytes as a little-endian u64 (zero-padded).
    pub fn u64(&mut self) -> u64 {
        let mut w = [0u8; 8];
        w.iter_mut().for_each(|b| *b = self.u8());
        u64::from_le_bytes(w)
    }
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
    /// A size: mostly small (0..=17), sometimes a raw 64-bit value (huge or overflowing).
    pub fn size(&mut self) -> usize {
        match self.u8() {
            b @ 0..=229 => usize::from(b % 18),
            230..=249 => usize::from(self.u8()) << (self.u8() % 16),
            _ => self.u64() as usize,
        }
    }
    /// A dimension: mostly `1..=max`, sometimes zero, sometimes huge.
    pub fn dim(&mut self, max: usize) -> usize {
        match self.u8() {
            b @ 0..=239 => 1 + usize::from(b) % max.max(1),
            240..=247 => 0,
            _ => self.u64() as usize,
        }
    }
    /// A list of up to 4 sizes.
    pub fn sizes(&mut self) -> Vec<usize> {
        let n = usize::from(self.u8() % 5);
        (0..n).map(|_| self.size()).collect()
    }
    /// Any f64 bit pattern (NaN, infinities, subnormals, negatives included).
    pub fn f64(&mut self) -> f64 {
        f64::from_bits(self.u64())
    }
    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.at..).unwrap_or(&[])
    }
}

/// How many of `cases` seeded random byte strings (lengths `0..max_len`) a fuzz body
/// says reached its deep checks: what keeps a bytes-driven proptest from being vacuous.
pub fn seeded_hits(seed: u64, cases: usize, max_len: usize, body: impl Fn(&[u8]) -> bool) -> usize {
    let mut rng = attn_testkit::rng::SeededRng::new(seed);
    (0..cases)
        .filter(|_| {
            let len = rng.range(0, max_len);
            let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
            body(&bytes)
        })
        .count()
}
