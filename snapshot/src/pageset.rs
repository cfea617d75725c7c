//! [`PageSet`]: which 4 KiB pages of a memory file a diff snapshot holds.

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Size of the pages [`PageSet`] and the memory-file helpers work in.
pub const PAGE_SIZE: u64 = 4096;

/// Number of pages needed to cover `len_bytes` (the last one possibly partial).
pub const fn pages_for(len_bytes: u64) -> u64 {
    len_bytes.div_ceil(PAGE_SIZE)
}

/// Why a [`PageSet`] operation or a deserialized `PageSet` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageSetError {
    /// A page index is outside the set's range.
    #[error("page {page} is outside the page set, which covers pages 0..{len_pages}")]
    OutOfRange {
        /// The offending page.
        page: u64,
        /// The number of pages the set covers.
        len_pages: u64,
    },
    /// Two sets of different sizes were combined.
    #[error("page sets of different sizes: {left} and {right} pages")]
    SizeMismatch {
        /// Pages covered by the receiving set.
        left: u64,
        /// Pages covered by the other set.
        right: u64,
    },
    /// A deserialized set is inconsistent.
    #[error("invalid page set: {reason} (len_pages {len_pages}, {words} bitmap words)")]
    Invalid {
        /// What is wrong.
        reason: &'static str,
        /// The page count found.
        len_pages: u64,
        /// The number of bitmap words found.
        words: usize,
    },
}

/// A set of 4 KiB pages of a memory file of `len_pages` pages: a bitmap, one bit per page
/// (bit `p % 64` of word `p / 64` is page `p`, i.e. the file bytes
/// `p * 4096 .. (p + 1) * 4096`), the same layout as KVM's dirty log.
///
/// It is what a diff snapshot records next to `memory.diff` so the pages can be merged back onto
/// their base. Serialized, it costs 8 bytes per 64 pages (8 KiB for 256 MiB of memory).
/// Deserialization checks consistency, so a set read from a state file can be trusted not to
/// hold pages beyond `len_pages`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "PageSetRepr")]
pub struct PageSet {
    len_pages: u64,
    words: Vec<u64>,
}

/// The serialized shape of [`PageSet`], checked on the way in.
#[derive(Deserialize)]
struct PageSetRepr {
    len_pages: u64,
    words: Vec<u64>,
}

impl TryFrom<PageSetRepr> for PageSet {
    type Error = PageSetError;

    fn try_from(repr: PageSetRepr) -> Result<Self, PageSetError> {
        let invalid = |reason| PageSetError::Invalid {
            reason,
            len_pages: repr.len_pages,
            words: repr.words.len(),
        };
        if repr.words.len() as u64 != repr.len_pages.div_ceil(64) {
            return Err(invalid("bitmap length does not match the page count"));
        }
        let spare = repr.len_pages % 64;
        if spare != 0 {
            let last = repr.words.last().copied().unwrap_or(0);
            if last >> spare != 0 {
                return Err(invalid("bits set beyond the last page"));
            }
        }
        Ok(PageSet {
            len_pages: repr.len_pages,
            words: repr.words,
        })
    }
}

impl fmt::Debug for PageSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Runs are far more readable than bitmap words.
        let mut runs = f.debug_list();
        for run in self.runs().take(32) {
            runs.entry(&run);
        }
        runs.finish()?;
        write!(f, " ({} of {} pages)", self.count(), self.len_pages)
    }
}

impl PageSet {
    /// An empty set covering a memory file of `len_bytes` bytes (rounded up to whole pages).
    pub fn new(len_bytes: u64) -> Self {
        Self::with_len_pages(pages_for(len_bytes))
    }

    /// An empty set covering `len_pages` pages.
    pub fn with_len_pages(len_pages: u64) -> Self {
        let words = usize::try_from(len_pages.div_ceil(64)).unwrap_or(usize::MAX);
        Self {
            len_pages,
            words: vec![0; words],
        }
    }

    /// How many pages the set covers (set or not).
    pub fn len_pages(&self) -> u64 {
        self.len_pages
    }

    /// How many pages are in the set.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Whether no page is in the set.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// Whether `page` is in the set (false for pages beyond the range).
    pub fn contains(&self, page: u64) -> bool {
        page < self.len_pages && self.word(page) & (1 << (page % 64)) != 0
    }

    /// Add `page`.
    ///
    /// # Errors
    /// [`PageSetError::OutOfRange`] if `page >= len_pages()`.
    pub fn insert(&mut self, page: u64) -> Result<(), PageSetError> {
        self.check(page)?;
        if let Some(w) = self.words.get_mut((page / 64) as usize) {
            *w |= 1 << (page % 64);
        }
        Ok(())
    }

    /// Add every page in `pages`.
    ///
    /// # Errors
    /// [`PageSetError::OutOfRange`] if the range reaches beyond `len_pages()`; nothing is added.
    pub fn insert_range(&mut self, pages: Range<u64>) -> Result<(), PageSetError> {
        if pages.is_empty() {
            return Ok(());
        }
        self.check(pages.end - 1)?;
        let mut page = pages.start;
        while page < pages.end {
            let bit = page % 64;
            let n = (64 - bit).min(pages.end - page);
            let mask = if n == 64 {
                !0
            } else {
                ((1u64 << n) - 1) << bit
            };
            if let Some(w) = self.words.get_mut((page / 64) as usize) {
                *w |= mask;
            }
            page += n;
        }
        Ok(())
    }

    /// Add every page that overlaps the byte range `offset .. offset + len` of the memory file.
    ///
    /// # Errors
    /// [`PageSetError::OutOfRange`] if the range reaches beyond the set; nothing is added.
    pub fn insert_bytes(&mut self, offset: u64, len: u64) -> Result<(), PageSetError> {
        if len == 0 {
            return Ok(());
        }
        let end = offset.checked_add(len).ok_or(PageSetError::OutOfRange {
            page: u64::MAX,
            len_pages: self.len_pages,
        })?;
        self.insert_range(offset / PAGE_SIZE..pages_for(end))
    }

    /// OR a KVM-style dirty bitmap (bit `i % 64` of word `i / 64` = page `i` of the slot) into
    /// the set, with the slot's first page at `first_page` of the memory file.
    ///
    /// # Errors
    /// [`PageSetError::OutOfRange`] if a set bit lands beyond `len_pages()`; nothing is added.
    pub fn insert_bitmap(&mut self, first_page: u64, bitmap: &[u64]) -> Result<(), PageSetError> {
        // Highest set bit decides whether everything fits.
        let Some((last_word, &w)) = bitmap.iter().enumerate().rev().find(|(_, &w)| w != 0) else {
            return Ok(());
        };
        let last_bit = last_word as u64 * 64 + u64::from(63 - w.leading_zeros());
        let last_page = first_page
            .checked_add(last_bit)
            .ok_or(PageSetError::OutOfRange {
                page: u64::MAX,
                len_pages: self.len_pages,
            })?;
        self.check(last_page)?;

        let base = (first_page / 64) as usize;
        let shift = first_page % 64;
        for (i, &w) in bitmap.iter().enumerate() {
            if w == 0 {
                continue;
            }
            if let Some(dst) = self.words.get_mut(base + i) {
                *dst |= w << shift;
            }
            if shift != 0 {
                if let Some(dst) = self.words.get_mut(base + i + 1) {
                    *dst |= w >> (64 - shift);
                }
            }
        }
        Ok(())
    }

    /// Add every page of `other`, which must cover the same number of pages.
    ///
    /// # Errors
    /// [`PageSetError::SizeMismatch`] if the sizes differ.
    pub fn union_with(&mut self, other: &PageSet) -> Result<(), PageSetError> {
        if self.len_pages != other.len_pages {
            return Err(PageSetError::SizeMismatch {
                left: self.len_pages,
                right: other.len_pages,
            });
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
        Ok(())
    }

    /// Remove every page.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// The pages in the set, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.runs().flatten()
    }

    /// Maximal runs of consecutive pages in the set, as page ranges, in increasing order.
    /// Multiply by [`PAGE_SIZE`] for file offsets.
    pub fn runs(&self) -> Runs<'_> {
        Runs { set: self, pos: 0 }
    }

    /// The bitmap words (bit `p % 64` of word `p / 64` is page `p`).
    pub fn as_words(&self) -> &[u64] {
        &self.words
    }

    fn check(&self, page: u64) -> Result<(), PageSetError> {
        if page < self.len_pages {
            Ok(())
        } else {
            Err(PageSetError::OutOfRange {
                page,
                len_pages: self.len_pages,
            })
        }
    }

    fn word(&self, page: u64) -> u64 {
        self.words.get((page / 64) as usize).copied().unwrap_or(0)
    }

    /// First page `>= from` whose bit equals `set`; `len_pages` if none.
    fn next_with(&self, from: u64, set: bool) -> u64 {
        if from >= self.len_pages {
            return self.len_pages;
        }
        let flip = if set { 0 } else { !0 };
        let mut idx = (from / 64) as usize;
        let mut word = (self.word(from) ^ flip) & (!0u64 << (from % 64));
        loop {
            if word != 0 {
                let page = idx as u64 * 64 + u64::from(word.trailing_zeros());
                return page.min(self.len_pages);
            }
            idx += 1;
            match self.words.get(idx) {
                Some(&w) => word = w ^ flip,
                None => return self.len_pages,
            }
        }
    }
}

/// Iterator over the runs of a [`PageSet`]; see [`PageSet::runs`].
#[derive(Debug, Clone)]
pub struct Runs<'a> {
    set: &'a PageSet,
    pos: u64,
}

impl Iterator for Runs<'_> {
    type Item = Range<u64>;

    fn next(&mut self) -> Option<Range<u64>> {
        let start = self.set.next_with(self.pos, true);
        if start >= self.set.len_pages {
            self.pos = start;
            return None;
        }
        let end = self.set.next_with(start, false);
        self.pos = end;
        Some(start..end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_runs(pages: &[bool]) -> Vec<Range<u64>> {
        let mut runs = Vec::new();
        let mut start = None;
        for (i, &p) in pages.iter().enumerate() {
            match (p, start) {
                (true, None) => start = Some(i as u64),
                (false, Some(s)) => {
                    runs.push(s..i as u64);
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(s) = start {
            runs.push(s..pages.len() as u64);
        }
        runs
    }

    #[test]
    fn insert_contains_and_runs() {
        let mut set = PageSet::new(300 * PAGE_SIZE - 1);
        assert_eq!(set.len_pages(), 300);
        assert!(set.is_empty());
        for p in [0, 1, 2, 63, 64, 65, 127, 128, 299] {
            set.insert(p).expect("in range");
        }
        set.insert_range(200..260).expect("in range");
        assert!(set.contains(63) && set.contains(299) && !set.contains(3) && !set.contains(300));
        assert_eq!(set.count(), 9 + 60);
        let runs: Vec<_> = set.runs().collect();
        assert_eq!(runs, [0..3, 63..66, 127..129, 200..260, 299..300]);
        assert_eq!(set.iter().count() as u64, set.count());
        assert!(matches!(
            set.insert(300),
            Err(PageSetError::OutOfRange {
                page: 300,
                len_pages: 300
            })
        ));
        assert!(set.insert_range(290..301).is_err());
        assert!(!set.contains(290));
        set.clear();
        assert!(set.is_empty());
        assert_eq!(set.runs().count(), 0);
    }

    #[test]
    fn runs_match_naive_on_patterns() {
        // Deterministic pseudo-random patterns with varying densities and lengths.
        let mut x = 0x1234_5678_9abc_def0u64;
        for len in [1u64, 63, 64, 65, 128, 1000, 4097] {
            for density in [1u64, 8, 50, 95, 100] {
                let mut set = PageSet::with_len_pages(len);
                let mut naive = vec![false; len as usize];
                for p in 0..len {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if x % 100 < density {
                        set.insert(p).expect("in range");
                        naive[p as usize] = true;
                    }
                }
                assert_eq!(
                    set.runs().collect::<Vec<_>>(),
                    naive_runs(&naive),
                    "{len}/{density}"
                );
            }
        }
    }

    #[test]
    fn insert_bytes_covers_partial_pages() {
        let mut set = PageSet::new(10 * PAGE_SIZE);
        set.insert_bytes(PAGE_SIZE - 1, 2).expect("in range");
        assert_eq!(
            set.runs().collect::<Vec<_>>(),
            vec![Range { start: 0, end: 2 }]
        );
        set.insert_bytes(5 * PAGE_SIZE, 0).expect("empty");
        assert_eq!(set.count(), 2);
        assert!(set.insert_bytes(9 * PAGE_SIZE, PAGE_SIZE + 1).is_err());
        assert!(set.insert_bytes(u64::MAX, 2).is_err());
    }

    #[test]
    fn insert_bitmap_aligned_and_shifted() {
        let bitmap = [0b1011u64, 1 << 63];
        for first in [0u64, 64, 5, 70] {
            let mut set = PageSet::with_len_pages(300);
            set.insert_bitmap(first, &bitmap).expect("fits");
            let pages: Vec<u64> = set.iter().collect();
            assert_eq!(
                pages,
                [first, first + 1, first + 3, first + 127],
                "first {first}"
            );
        }
        let mut set = PageSet::with_len_pages(128);
        assert!(set.insert_bitmap(1, &bitmap).is_err());
        assert!(set.is_empty());
        set.insert_bitmap(1000, &[0, 0])
            .expect("no bits set, nothing to place");
    }

    #[test]
    fn union_requires_same_size() {
        let mut a = PageSet::with_len_pages(10);
        let mut b = PageSet::with_len_pages(10);
        a.insert(1).expect("ok");
        b.insert(9).expect("ok");
        a.union_with(&b).expect("same size");
        assert_eq!(a.iter().collect::<Vec<_>>(), [1, 9]);
        assert!(a.union_with(&PageSet::with_len_pages(11)).is_err());
    }

    #[test]
    fn serde_round_trip_and_validation() {
        let mut set = PageSet::with_len_pages(70);
        set.insert_range(3..68).expect("ok");
        let json = serde_json::to_string(&set).expect("json");
        let back: PageSet = serde_json::from_str(&json).expect("back");
        assert_eq!(back, set);
        let bin = bincode::serialize(&set).expect("bincode");
        assert_eq!(bin.len(), 8 + 8 + 2 * 8);
        let back: PageSet = bincode::deserialize(&bin).expect("back");
        assert_eq!(back, set);

        for bad in [
            r#"{"len_pages":70,"words":[0]}"#,
            r#"{"len_pages":18446744073709551615,"words":[]}"#,
            r#"{"len_pages":70,"words":[0,64]}"#,
        ] {
            let err = serde_json::from_str::<PageSet>(bad).expect_err(bad);
            assert!(err.to_string().contains("invalid page set"), "{err}");
        }
        let ok: PageSet = serde_json::from_str(r#"{"len_pages":70,"words":[0,63]}"#).expect("ok");
        assert_eq!(ok.count(), 6);
    }

    #[test]
    fn debug_shows_runs() {
        let mut set = PageSet::with_len_pages(10);
        set.insert_range(2..5).expect("ok");
        assert_eq!(format!("{set:?}"), "[2..5] (3 of 10 pages)");
    }
}
