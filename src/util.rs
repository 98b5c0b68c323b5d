//! Small helpers with no better home: randomness, time formatting, secret masking, backoff.

use std::io::Read;
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

/// `n` bytes from the kernel's CSPRNG. Falls back to a time-and-pid mix if /dev/urandom is
/// unreadable (never on Linux in practice), so ids stay unique even then.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut buf = [0u8; N];
    let ok = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .is_ok();
    if !ok {
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

/// RFC 3339 UTC timestamp with microseconds, e.g. `2026-11-29T15:48:12.123456Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = d.as_secs() as i64;
    let (y, m, day) = civil_from_days(secs.div_euclid(86_400));
    let rem = secs.rem_euclid(86_400);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// Days since 1970-01-01 → (year, month, day), Howard Hinnant's algorithm.
// `z` comes from a u64 of seconds / 86 400 (|z| < 2.2e14): every step stays far inside i64.
#[allow(clippy::arithmetic_side_effects)]
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
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

/// SHA-256 of `data` (FIPS 180-4), for the token-derived MQTT username. Hand-written: it runs
/// once per start on a few bytes, and the crate list has no digest crate.
// Fixed-size arrays indexed by the constant loop bounds of the standard (0..64, 16..64).
#[allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]
pub fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64).wrapping_mul(8)).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (o, x) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&x.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
