//! Small helpers with no better home: randomness, time formatting, secret masking, backoff.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The longest span the node ever waits for: timers further out are clamped to it.
const CENTURY: Duration = Duration::from_secs(3_155_760_000);

/// Seconds (from a command, the environment or a manifest) as a `Duration`, without the panic
/// of `Duration::from_secs_f64`: NaN and negatives are zero, anything beyond a century is a
/// century.
pub fn secs_f64(s: f64) -> Duration {
    if s.is_nan() || s <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(s).map_or(CENTURY, |d| d.min(CENTURY))
}

/// `now + d` without the overflow panic of `Instant + Duration` (`d` is clamped to a century,
/// which the monotonic clock always holds).
pub fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d.min(CENTURY)).unwrap_or(now)
}

/// `v[key] = x` on a JSON object the node builds, without `IndexMut`'s panic on a non-object.
pub fn set(v: &mut serde_json::Value, key: &str, x: serde_json::Value) {
    if let Some(o) = v.as_object_mut() {
        o.insert(key.to_string(), x);
    }
}

/// `N` bytes from the kernel's CSPRNG (the `getrandom` crate: `getrandom(2)`, else
/// `/dev/urandom`). These name files and requests and guard nothing, so if the kernel gives none
/// (never on Linux in practice) a time-and-pid mix keeps the ids unique.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut buf = [0u8; N];
    if getrandom::fill(&mut buf).is_err() {
        let mut x = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ (u64::from(std::process::id()) << 32);
        for b in buf.iter_mut() {
            // xorshift64*
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            *b = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8;
        }
    }
    buf
}

/// `N` bytes for a secret (an event token), from the kernel's CSPRNG, or `None`: a secret never
/// falls back to guessable bytes.
pub fn secret_bytes<const N: usize>() -> Option<[u8; N]> {
    secret_from(getrandom::fill)
}

/// `N` bytes that `fill` gave in full, or `None` when it failed.
fn secret_from<const N: usize>(
    fill: impl FnOnce(&mut [u8]) -> Result<(), getrandom::Error>,
) -> Option<[u8; N]> {
    let mut buf = [0u8; N];
    fill(&mut buf).ok().map(|()| buf)
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    #[test]
    fn random_bytes_differ_from_call_to_call() {
        let (a, b) = (random_bytes::<16>(), random_bytes::<16>());
        assert_ne!(a, b);
        assert_ne!(a, [0u8; 16]);
    }

    #[test]
    fn g13_a_secret_fails_closed_when_the_kernel_gives_no_random_bytes() {
        let none = |_: &mut [u8]| Err(getrandom::Error::UNSUPPORTED);
        assert_eq!(secret_from::<16>(none), None);
        let ones = |b: &mut [u8]| {
            b.fill(1);
            Ok(())
        };
        assert_eq!(secret_from::<16>(ones), Some([1u8; 16]));
        let (a, b) = (secret_bytes::<16>(), secret_bytes::<16>());
        assert!(a.is_some() && a != b);
    }
}

/// Whether two secrets are equal, in a time that does not depend on where they first differ
/// (only on their lengths), so a local client cannot guess a token byte by byte.
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random version-4 UUID in its canonical text form.
pub fn uuid_v4() -> String {
    let mut b = random_bytes::<16>();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Shows a secret as `cw_…last4` (or `…last4` without the `cw_` prefix); short secrets show
/// nothing of themselves at all.
pub fn mask_secret(secret: &str) -> String {
    let chars: Vec<char> = secret.chars().collect();
    let prefix = if secret.starts_with("cw_") { "cw_" } else { "" };
    if chars.len() < 12 {
        return format!("{prefix}…");
    }
    let tail: String = chars.iter().skip(chars.len().saturating_sub(4)).collect();
    format!("{prefix}…{tail}")
}

/// RFC 3339 UTC timestamp with microseconds, e.g. `2026-11-29T15:48:12.123456Z`. A time before
/// 1970 shows as the epoch, one past the year 9999 as its last microsecond.
pub fn rfc3339(t: SystemTime) -> String {
    let ts = if t < UNIX_EPOCH {
        jiff::Timestamp::UNIX_EPOCH
    } else {
        jiff::Timestamp::try_from(t).unwrap_or(jiff::Timestamp::MAX)
    };
    rfc3339_of(ts)
}

/// A `jiff` timestamp in the same form as [`rfc3339`] (microseconds, truncated; `Z`).
pub fn rfc3339_of(ts: jiff::Timestamp) -> String {
    jiff::fmt::temporal::DateTimePrinter::new()
        .precision(Some(6))
        .timestamp_to_string(&ts)
}

/// Exponential backoff with full jitter: attempt 0 waits up to `base`, each later attempt
/// doubles the ceiling up to `cap`; the actual wait is uniform in [0, ceiling], never below
/// 10 ms so a tight loop is impossible.
pub fn backoff_full_jitter(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let ceiling = base
        .checked_mul(1u32 << attempt.min(20))
        .unwrap_or(cap)
        .min(cap);
    let r = u64::from_le_bytes(random_bytes::<8>());
    let frac = (r >> 11) as f64 / (1u64 << 53) as f64;
    ceiling.mul_f64(frac).max(Duration::from_millis(10))
}

/// SHA-256 of `data` (FIPS 180-4): the token-derived MQTT username, hashed long request ids.
/// This process's effective uid (the owner its files get, and whom it acts as).
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// This process's real uid.
pub fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

pub fn sha256(data: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(data).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_compare_equal_only_when_every_byte_is() {
        assert!(same_secret("abc123", "abc123"));
        assert!(same_secret("", ""));
        assert!(!same_secret("abc123", "abc124"));
        assert!(!same_secret("abc123", "xbc123"));
        assert!(!same_secret("abc123", "abc12"));
        assert!(!same_secret("abc", ""));
        assert!(!same_secret("é", "e\u{301}"));
    }

    #[test]
    fn sha256_matches_the_standard_vectors() {
        let cases: [(&[u8], &str); 4] = [
            (
                b"",
                "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
            ),
            (
                b"abc",
                "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            ),
            (
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
                "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
            ),
            (
                &[b'a'; 1000],
                "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(hex(&sha256(input)), want, "{} bytes", input.len());
        }
    }

    #[test]
    fn masks_secrets_without_revealing_short_ones() {
        assert_eq!(mask_secret("cw_abcdefghijklmnop"), "cw_…mnop");
        assert_eq!(mask_secret("plainsecret-1234"), "…1234");
        assert_eq!(mask_secret("cw_short"), "cw_…");
        assert_eq!(mask_secret(""), "…");
    }

    #[test]
    fn formats_rfc3339() {
        let t = UNIX_EPOCH + Duration::from_micros(1_764_431_292_123_456);
        assert_eq!(rfc3339(t), "2025-11-29T15:48:12.123456Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        // a leap day
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000000Z"
        );
        // Out of range: clamped, never a panic.
        assert_eq!(
            rfc3339(UNIX_EPOCH - Duration::from_secs(1)),
            "1970-01-01T00:00:00.000000Z"
        );
        if let Some(far) = UNIX_EPOCH.checked_add(Duration::from_secs(1 << 40)) {
            assert_eq!(rfc3339(far), "9999-12-30T22:00:00.999999Z");
        }
    }

    #[test]
    fn seconds_and_deadlines_saturate_instead_of_panicking() {
        assert_eq!(secs_f64(1.5), Duration::from_millis(1500));
        for bad in [f64::NAN, -1.0, f64::NEG_INFINITY, 0.0, -0.0] {
            assert_eq!(secs_f64(bad), Duration::ZERO, "{bad}");
        }
        for huge in [1e19, f64::INFINITY, f64::MAX] {
            assert_eq!(secs_f64(huge), CENTURY, "{huge}");
        }
        let now = Instant::now();
        assert_eq!(later(now, Duration::MAX), now + CENTURY);
        assert_eq!(
            later(now, Duration::from_secs(2)),
            now + Duration::from_secs(2)
        );
        let mut v = serde_json::json!({"a": 1});
        set(&mut v, "b", serde_json::json!(2));
        assert_eq!(v, serde_json::json!({"a": 1, "b": 2}));
        let mut n = serde_json::json!(5);
        set(&mut n, "b", serde_json::json!(2));
        assert_eq!(n, serde_json::json!(5));
    }

    #[test]
    fn uuid_has_v4_shape() {
        let u = uuid_v4();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(uuid_v4(), u);
    }

    #[test]
    fn backoff_stays_within_ceiling() {
        let base = Duration::from_millis(500);
        let cap = Duration::from_secs(30);
        for attempt in 0..40 {
            let d = backoff_full_jitter(attempt, base, cap);
            assert!(d <= cap, "{d:?}");
            if attempt == 0 {
                assert!(d <= base);
            }
        }
    }
}
