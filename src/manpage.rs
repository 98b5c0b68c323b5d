//! The man page (`__man`) and the shell completions (`__completions bash|zsh|fish`), generated
//! from the same data as `--help`: the command list and flag lists of `cli`, and the help texts
//! themselves (every flag a help text names is offered too). The packages install the output,
//! so neither can drift from `--help`; a unit test and packaging/check.sh hold them to it.

use crate::cli::{self, Command};

/// Flags every command takes (`cli::parse` handles them before the command's own flags).
pub const GLOBAL_FLAGS: &[&str] = &["--help", "-h", "--version", "-V", "--verbose", "-v", "-vv"];

/// Flags whose value is a file path (completed with file names).
const PATH_FLAGS: &[&str] = &["--config", "--metrics-file"];

/// Writes `text` to stdout: exit 0, also when the reader went away (`__man | head`), 1 when
/// stdout cannot be written otherwise.
pub fn print(text: &str) -> i32 {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => crate::error::Exit::Ok.code(),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => crate::error::Exit::Ok.code(),
        Err(e) => {
            let _ = writeln!(
                std::io::stderr(),
                "error: cannot write to standard output: {e}"
            );
            crate::error::Exit::Runtime.code()
        }
    }
}

/// The flags a help text names: tokens starting with `-` then a letter (`--mqtt-tls/--no-mqtt-tls`,
/// `[-f]` and `(--wait:` included), in order of appearance, without duplicates.
pub fn flags_in(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let separators = |c: char| c.is_whitespace() || "[](),/|=:;`'\"".contains(c);
    for token in text.split(separators) {
        let token = token.trim_end_matches('.');
        let name = token.trim_start_matches('-');
        let dashes = token.len().saturating_sub(name.len());
        let valid = (1..=2).contains(&dashes)
            && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if valid && !out.iter().any(|f| f == token) {
            out.push(token.to_string());
        }
    }
    out
}

/// Everything `cmd` takes: its help text's flags, the parser's list, and the global flags.
pub fn all_flags(cmd: Command) -> Vec<String> {
    let mut out = flags_in(&cli::help_text(Some(cmd)));
    for f in cli::flags_of(cmd)
        .into_iter()
        .chain(GLOBAL_FLAGS.iter().copied())
    {
        if !out.iter().any(|o| o == f) {
            out.push(f.to_string());
        }
    }
    out
}

/// The one-line summary of a command: the first line of its help text.
fn summary(cmd: Command) -> String {
    cli::help_text(Some(cmd))
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end_matches('.')
        .to_string()
}

/// Text made safe for roff: backslashes and minus signs escaped, no line starting with a
/// control character, anything outside ASCII as a `\[uXXXX]` escape.
fn roff(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line.starts_with('.') || line.starts_with('\'') {
            out.push_str("\\&");
        }
        for c in line.chars() {
            match c {
                '\\' => out.push_str("\\e"),
                '-' => out.push_str("\\-"),
                c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
                c if c.is_ascii_control() => {}
                c => out.push_str(&format!("\\[u{:04X}]", u32::from(c))),
            }
        }
        out.push('\n');
    }
    out
}

/// The man page, section 1.
pub fn man_page() -> String {
    let top = cli::help_text(None);
    let mut lines = top.lines();
    let title = lines.next().unwrap_or_default();
    let what = title.split_once(": ").map_or(title, |(_, w)| w);
    let what = what.trim_end_matches('.');
    let rest: Vec<&str> = lines.skip_while(|l| l.trim().is_empty()).collect();
    let mut m = String::new();
    m.push_str(&format!(
        ".TH CYBERWAVE\\-CLOUD\\-NODE 1 \"\" \"cyberwave\\-cloud\\-node {}\" \"User Commands\"\n",
        roff(cli::VERSION).trim_end()
    ));
    m.push_str(".SH NAME\ncyberwave\\-cloud\\-node \\- ");
    m.push_str(&roff(what));
    m.push_str(".SH SYNOPSIS\n.B cyberwave\\-cloud\\-node\n[\\fICOMMAND\\fR] [\\fIFLAGS\\fR]\n");
    m.push_str(".SH DESCRIPTION\n");
    m.push_str(&roff(title));
    m.push_str(".PP\nThe text below is the output of \\fB\\-\\-help\\fR and of \\fBcyberwave\\-cloud\\-node \\fICOMMAND\\fB \\-\\-help\\fR.\n");
    m.push_str(".PP\n.nf\n");
    m.push_str(&roff(&rest.join("\n")));
    m.push_str(".fi\n.SH COMMANDS\n");
    for &cmd in cli::COMMANDS {
        m.push_str(&format!(
            ".SS {}\n.nf\n",
            roff(cli::name_of(cmd)).trim_end()
        ));
        m.push_str(&roff(&cli::help_text(Some(cmd))));
        m.push_str(".fi\n");
    }
    m.push_str(
        ".SH FILES\n\
.TP\n.I /etc/cyberwave/cloud\\-node.env\n\
the service's settings, among them the API key (mode 0600)\n\
.TP\n.I /var/lib/cyberwave\\-cloud\\-node\n\
the node's state: identity, workload records and logs\n\
.TP\n.I /lib/systemd/system/cyberwave\\-cloud\\-node.service\n\
the systemd unit of the packages\n\
.SH SEE ALSO\n\
.BR systemctl (1),\n\
.BR journalctl (1)\n",
    );
    m
}

/// `--config` and `--metrics-file` complete file names; other value flags complete nothing.
fn value_flags() -> (Vec<String>, Vec<String>) {
    let mut every: Vec<String> = Vec::new();
    for &cmd in cli::COMMANDS {
        for f in all_flags(cmd) {
            if !every.contains(&f) {
                every.push(f);
            }
        }
    }
    let (paths, others): (Vec<String>, Vec<String>) = every
        .into_iter()
        .filter(|f| cli::takes_value(f) || f == "-n")
        .partition(|f| PATH_FLAGS.contains(&f.as_str()));
    (paths, others)
}

/// The flags completed before any command: the global ones and those of `start` (the default).
fn no_command_flags() -> Vec<String> {
    all_flags(Command::Start)
}

/// A completion script for `shell` (bash, zsh or fish), or None for another shell.
pub fn completions(shell: &str) -> Option<String> {
    match shell {
        "bash" => Some(bash()),
        "zsh" => Some(zsh()),
        "fish" => Some(fish()),
        _ => None,
    }
}

fn names() -> Vec<&'static str> {
    cli::COMMANDS.iter().map(|&c| cli::name_of(c)).collect()
}

fn bash() -> String {
    let (paths, others) = value_flags();
    let mut s = String::from(
        "# bash completion for cyberwave-cloud-node (generated by `cyberwave-cloud-node __completions bash`)\n\
_cyberwave_cloud_node() {\n\
    local cur prev cmd i flags\n\
    cur=\"${COMP_WORDS[COMP_CWORD]}\"\n\
    prev=\"${COMP_WORDS[COMP_CWORD-1]}\"\n\
    cmd=\"\"\n\
    for ((i = 1; i < COMP_CWORD; i++)); do\n\
        case \"${COMP_WORDS[i]}\" in\n",
    );
    s.push_str(&format!(
        "            {}) cmd=\"${{COMP_WORDS[i]}}\"; break ;;\n        esac\n    done\n",
        names().join("|")
    ));
    s.push_str(&format!(
        "    case \"$prev\" in\n        {}) COMPREPLY=($(compgen -f -- \"$cur\")); return ;;\n        {}) COMPREPLY=(); return ;;\n    esac\n",
        paths.join("|"),
        others.join("|")
    ));
    s.push_str("    case \"$cmd\" in\n");
    for &cmd in cli::COMMANDS {
        s.push_str(&format!(
            "        {}) flags=\"{}\" ;;\n",
            cli::name_of(cmd),
            all_flags(cmd).join(" ")
        ));
    }
    s.push_str(&format!(
        "        *) flags=\"{}\" ;;\n    esac\n",
        no_command_flags().join(" ")
    ));
    s.push_str(&format!(
        "    if [[ \"$cur\" == -* ]]; then\n\
        COMPREPLY=($(compgen -W \"$flags\" -- \"$cur\"))\n\
    elif [[ -z \"$cmd\" ]]; then\n\
        COMPREPLY=($(compgen -W \"{} help\" -- \"$cur\"))\n\
    elif [[ \"$cmd\" == validate ]]; then\n\
        COMPREPLY=($(compgen -f -- \"$cur\"))\n\
    elif [[ \"$cmd\" == emit ]]; then\n\
        COMPREPLY=($(compgen -W \"started node finished\" -- \"$cur\"))\n\
    fi\n\
}}\n\
complete -F _cyberwave_cloud_node cyberwave-cloud-node\n",
        names().join(" ")
    ));
    s
}

/// `text` inside single quotes for zsh and bash: `'` becomes `'\''`.
fn sh_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

fn zsh() -> String {
    let (paths, others) = value_flags();
    let mut s = String::from(
        "#compdef cyberwave-cloud-node\n\
# zsh completion for cyberwave-cloud-node (generated by `cyberwave-cloud-node __completions zsh`)\n\
local cmd i\n\
local -a commands flags\n\
commands=(\n",
    );
    for &cmd in cli::COMMANDS {
        let entry = format!(
            "{}:{}",
            cli::name_of(cmd),
            summary(cmd).replace('\\', "\\\\").replace(':', "\\:")
        );
        s.push_str(&format!("  {}\n", sh_quote(&entry)));
    }
    s.push_str(&format!(
        ")\n\
for (( i = 2; i < CURRENT; i++ )); do\n\
  case ${{words[i]}} in\n\
    ({}) cmd=${{words[i]}}; break ;;\n\
  esac\n\
done\n\
case ${{words[CURRENT-1]}} in\n\
  ({}) _files; return ;;\n\
  ({}) return ;;\n\
esac\n\
case $cmd in\n",
        names().join("|"),
        paths.join("|"),
        others.join("|")
    ));
    for &cmd in cli::COMMANDS {
        s.push_str(&format!(
            "  ({}) flags=({}) ;;\n",
            cli::name_of(cmd),
            all_flags(cmd).join(" ")
        ));
    }
    s.push_str(&format!(
        "  (*) flags=({}) ;;\n\
esac\n\
if [[ ${{words[CURRENT]}} == -* ]]; then\n\
  compadd -- $flags\n\
elif [[ -z $cmd ]]; then\n\
  _describe -t commands 'cyberwave-cloud-node command' commands\n\
elif [[ $cmd == validate ]]; then\n\
  _files\n\
elif [[ $cmd == emit ]]; then\n\
  compadd -- started node finished\n\
fi\n",
        no_command_flags().join(" ")
    ));
    s
}

/// `text` inside single quotes for fish: `\` and `'` are escaped with a backslash.
fn fish_quote(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// One `complete` line for `flag` under `condition`.
fn fish_flag(condition: &str, flag: &str) -> String {
    let (kind, name) = match flag.strip_prefix("--") {
        Some(long) => ("-l", long),
        None => {
            let short = flag.trim_start_matches('-');
            (if short.len() == 1 { "-s" } else { "-o" }, short)
        }
    };
    let value = if PATH_FLAGS.contains(&flag) {
        " -r -F"
    } else if cli::takes_value(flag) || flag == "-n" {
        " -x"
    } else {
        ""
    };
    format!("complete -c cyberwave-cloud-node -n {condition} {kind} {name}{value}\n")
}

fn fish() -> String {
    let all = names().join(" ");
    let mut s = String::from(
        "# fish completion for cyberwave-cloud-node (generated by `cyberwave-cloud-node __completions fish`)\n\
complete -c cyberwave-cloud-node -f\n",
    );
    for &cmd in cli::COMMANDS {
        s.push_str(&format!(
            "complete -c cyberwave-cloud-node -n {} -a {} -d {}\n",
            fish_quote(&format!("not __fish_seen_subcommand_from {all}")),
            cli::name_of(cmd),
            fish_quote(&summary(cmd))
        ));
    }
    let none = fish_quote(&format!("not __fish_seen_subcommand_from {all}"));
    for f in no_command_flags() {
        s.push_str(&fish_flag(&none, &f));
    }
    for &cmd in cli::COMMANDS {
        let cond = fish_quote(&format!(
            "__fish_seen_subcommand_from {}",
            cli::name_of(cmd)
        ));
        for f in all_flags(cmd) {
            s.push_str(&fish_flag(&cond, &f));
        }
    }
    s.push_str(
        "complete -c cyberwave-cloud-node -n '__fish_seen_subcommand_from validate' -F\n\
complete -c cyberwave-cloud-node -n '__fish_seen_subcommand_from emit' -a 'started node finished'\n",
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every command `--help` lists and every flag any help text names.
    fn help_words() -> (Vec<String>, Vec<String>) {
        let top = cli::help_text(None);
        let commands: Vec<String> = top
            .split("Commands:")
            .nth(1)
            .and_then(|t| t.split("\n\n").next())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().split("  ").next())
            .flat_map(|names| names.split(", "))
            .map(str::to_string)
            .filter(|n| !n.is_empty())
            .collect();
        let mut flags = flags_in(&top);
        for &c in cli::COMMANDS {
            flags.extend(flags_in(&cli::help_text(Some(c))));
        }
        (commands, flags)
    }

    #[test]
    fn every_command_and_flag_of_help_is_in_the_man_page_and_completions() {
        let (commands, flags) = help_words();
        assert!(commands.len() >= 11, "{commands:?}");
        assert!(flags.iter().any(|f| f == "--mqtt-port") && flags.iter().any(|f| f == "-f"));
        let man = man_page().replace("\\-", "-");
        let scripts: Vec<(&str, String)> = ["bash", "zsh", "fish"]
            .iter()
            .map(|sh| (*sh, completions(sh).unwrap_or_default()))
            .collect();
        for c in &commands {
            assert!(man.contains(&format!(".SS {c}\n")), "man page lacks {c}");
            for (sh, s) in &scripts {
                assert!(s.contains(c.as_str()), "{sh} lacks {c}");
            }
        }
        for f in &flags {
            assert!(man.contains(f.as_str()), "man page lacks {f}");
            let fish_name = f.trim_start_matches('-');
            for (sh, s) in &scripts {
                let found = if *sh == "fish" {
                    s.lines().any(|l| {
                        l.ends_with(&format!(" {fish_name}"))
                            || l.contains(&format!(" {fish_name} -"))
                    })
                } else {
                    s.split([' ', '(', ')', '"', '|']).any(|w| w == f)
                };
                assert!(found, "{sh} completion lacks {f}");
            }
        }
        assert_eq!(completions("tcsh"), None);
    }

    #[test]
    fn every_listed_command_is_one_the_parser_knows() {
        for &c in cli::COMMANDS {
            let args = [cli::name_of(c).to_string(), "--help".to_string()];
            assert_eq!(
                cli::parse(&args),
                Ok(cli::Parsed::Help(cli::help_text(Some(c)))),
                "{args:?}"
            );
        }
    }

    #[test]
    fn global_and_path_flags_are_real_flags() {
        for f in GLOBAL_FLAGS {
            assert!(cli::parse(&[f.to_string()]).is_ok(), "{f}");
        }
        for f in PATH_FLAGS {
            assert!(cli::takes_value(f), "{f}");
        }
    }

    #[test]
    fn flags_in_finds_flags_only() {
        let t = "Usage: x [-f] (--wait: y) --mqtt-tls/--no-mqtt-tls --a=b one-shot -- - -1 --x. `daemon-reload` ---z --ünï";
        assert_eq!(
            flags_in(t),
            ["-f", "--wait", "--mqtt-tls", "--no-mqtt-tls", "--a", "--x"]
        );
    }

    #[test]
    fn roff_escapes_what_roff_would_interpret() {
        assert_eq!(
            roff(".TH x\n'a\n\\b -c é\u{7}"),
            "\\&.TH x\n\\&'a\n\\eb \\-c \\[u00E9]\n"
        );
    }

    #[test]
    fn quoting_survives_quotes() {
        assert_eq!(sh_quote("it's"), "'it'\\''s'");
        assert_eq!(fish_quote("a'b\\c"), "'a\\'b\\\\c'");
    }
}
