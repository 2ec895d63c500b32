"""``aenv_cli.dockerfile``: a Dockerfile into the build API's steps (every instruction
form, continuations, variables, what is ignored and what is refused, with its line) and
``aenv_cli.build_context``: which files a COPY sends, their hash and archive. Pure: no
server, no Django."""
import gzip
import io
import os
import tarfile
import textwrap

import pytest

from aenv_cli.build_context import BuildContext, ContextError, DockerIgnore, files_hash, write_archive
from aenv_cli.dockerfile import parse
from aenv_cli.dockerfile_syntax import DockerfileError

HEAD = [("USER", ["root"]), ("WORKDIR", ["/"])]
TAIL = [("USER", ["user"]), ("WORKDIR", ["/home/user"])]


def steps(text: str) -> list[tuple[str, list[str]]]:
    return [(s.type, s.args) for s in parse(textwrap.dedent(text)).steps]


def body(text: str) -> list[tuple[str, list[str]]]:
    """The steps between the implicit head and tail."""
    got = steps(text)
    assert got[:2] == HEAD and got[-2:] == TAIL, got
    return got[2:-2]


def error(text: str) -> DockerfileError:
    with pytest.raises(DockerfileError) as raised:
        parse(textwrap.dedent(text))
    return raised.value


# --------------------------------------------------------------------------- FROM


def test_from_and_the_implicit_user_and_workdir_steps():
    recipe = parse("FROM python:3.11-slim\n")
    assert recipe.from_image == "python:3.11-slim" and recipe.start_cmd is None and recipe.warnings == []
    assert [(s.type, s.args, s.line) for s in recipe.steps] == [
        ("USER", ["root"], 0), ("WORKDIR", ["/"], 0), ("USER", ["user"], 0), ("WORKDIR", ["/home/user"], 0)]


def test_a_single_stage_may_be_named_and_arg_before_from_fills_the_image():
    recipe = parse("ARG BASE=debian\nARG TAG=bookworm\nFROM ${BASE}:$TAG AS app\nRUN true\n")
    assert recipe.from_image == "debian:bookworm"
    assert [s.type for s in recipe.steps] == ["USER", "WORKDIR", "RUN", "USER", "WORKDIR"]  # no ENV from those ARGs


def test_an_arg_before_from_without_a_usable_value_leaves_from_unresolved():
    assert "undefined ARG" in error("ARG BASE\nFROM $BASE\n").message
    assert "undefined ARG" in error("ARG BASE=$OTHER\nFROM ${BASE}\n").message


def test_from_platform_is_ignored_with_a_warning():
    recipe = parse("FROM --platform=linux/amd64 alpine\n")
    assert recipe.from_image == "alpine" and recipe.warnings == [
        "line 1: FROM --platform is ignored (the node's architecture is used)"]


@pytest.mark.parametrize("text, line, words", [
    ("RUN true\n", None, "no FROM"),
    ("FROM a AS b\nRUN x\nFROM c\n", 3, "multi-stage"),
    ("FROM a\nCOPY --from=b /x /y\n", 2, "--from"),
    ("RUN true\nFROM a\n", 1, "RUN before FROM"),
    ("FROM a b\n", 1, "FROM takes an image"),
    ("FROM $UNDEFINED\n", 1, "undefined ARG"),
    ("FROM --foo=1 a\n", 1, "unknown FROM flag --foo"),
])
def test_from_errors(text, line, words):
    exc = error(text)
    assert exc.line == line and words in exc.message
    assert str(exc) == (f"line {line}: {exc.message}" if line else exc.message)


# --------------------------------------------------------------------------- RUN


def test_run_shell_form_is_kept_as_written():
    assert body("""\
        FROM a
        RUN echo "$HOME" 'single' | tr a b && echo `date` $(id -u)
        RUN   apt-get   update
    """) == [("RUN", ["echo \"$HOME\" 'single' | tr a b && echo `date` $(id -u)"]), ("RUN", ["apt-get   update"])]


def test_run_exec_form_is_quoted_and_joined():
    assert body('FROM a\nRUN ["echo", "a b", "it\'s", "$HOME"]\n') == [("RUN", ["echo 'a b' 'it'\"'\"'s' '$HOME'"])]


def test_invalid_json_is_the_shell_form_as_in_docker():
    assert body("FROM a\nRUN [ -f /etc/passwd ] && echo yes\n") == [("RUN", ["[ -f /etc/passwd ] && echo yes"])]


def test_line_continuations_comments_and_blank_lines_inside():
    recipe = parse(textwrap.dedent("""\
        # a comment
        FROM a

        RUN apt-get update && \\
            # a comment inside the continuation
            apt-get install -y \\

              curl  \t
        RUN echo done
    """))
    run = [s for s in recipe.steps if s.type == "RUN"]
    assert [(s.args, s.line) for s in run] == [(["apt-get update &&     apt-get install -y       curl"], 4),
                                              (["echo done"], 9)]


def test_the_escape_directive_changes_the_continuation_character():
    text = "# escape=`\nFROM a\nRUN echo a `\n  b\nCOPY a\\b.txt c:\\dest\n"
    assert body(text) == [("RUN", ["echo a   b"]), ("COPY", ["a\\b.txt", "c:\\dest", "", ""])]


def test_run_flags():
    recipe = parse("FROM a\nRUN --mount=type=cache,target=/root/.cache --network=host pip install x\n")
    assert [s.args for s in recipe.steps if s.type == "RUN"] == [["pip install x"]]
    assert recipe.warnings == ["line 2: RUN --mount is ignored", "line 2: RUN --network is ignored"]
    assert "type=secret" in error("FROM a\nRUN --mount=type=secret,id=x cat /run/secrets/x\n").message
    assert error("FROM a\nRUN --bogus x\n").message == "unknown RUN flag --bogus"


@pytest.mark.parametrize("text", ["FROM a\nRUN <<EOF\necho hi\nEOF\n", "FROM a\nRUN cat <<-'END' > /x\nhi\nEND\n",
                                  "FROM a\nRUN python3 <<\"PY\"\nprint(1)\nPY\n"])
def test_heredocs_are_refused_on_their_line(text):
    exc = error(text)
    assert exc.line == 2 and "heredocs" in exc.message


def test_here_strings_and_quoted_arrows_are_not_heredocs():
    assert body("FROM a\nRUN cat <<< hi && echo '<<EOF'\n") == [("RUN", ["cat <<< hi && echo '<<EOF'"])]


def test_run_needs_a_command():
    assert error("FROM a\nRUN\n").message == "RUN needs a command"


# --------------------------------------------------------------------------- COPY / ADD


def test_copy_forms_owner_and_mode():
    assert body("""\
        FROM a
        COPY app/ /app
        COPY --chown=user:staff --chmod=755 run.sh /usr/local/bin/
        COPY --chmod=0600 ["my file.txt", "/etc/x y"]
        ADD --chown=root b.txt /b
    """) == [("COPY", ["app/", "/app", "", ""]), ("COPY", ["run.sh", "/usr/local/bin/", "user:staff", "0755"]),
             ("COPY", ["my file.txt", "/etc/x y", "", "0600"]), ("COPY", ["b.txt", "/b", "root", ""])]


def test_several_sources_give_a_step_each_and_need_a_directory():
    recipe = parse("FROM a\nCOPY --chmod=644 a.txt 'b c.txt' dir/* /dest/\n")
    copies = [(s.args, s.line) for s in recipe.copies]
    assert copies == [(["a.txt", "/dest/", "", "0644"], 2), (["b c.txt", "/dest/", "", "0644"], 2),
                      (["dir/*", "/dest/", "", "0644"], 2)]
    exc = error("FROM a\nCOPY a b /dest\n")
    assert exc.line == 2 and "ending in '/'" in exc.message


def test_copy_link_is_ignored_and_other_flags_refused():
    assert parse("FROM a\nCOPY --link a /a\n").warnings == ["line 2: COPY --link is ignored"]
    assert error("FROM a\nCOPY --parents a/b /x/\n").message == "COPY --parents is not supported"
    assert "octal" in error("FROM a\nCOPY --chmod=u+x a /a\n").message
    assert error("FROM a\nCOPY --chown a /a\n").message == "COPY --chown needs a value"


@pytest.mark.parametrize("text, words", [
    ("FROM a\nADD https://example.com/x.tgz /x\n", "URL"),
    ("FROM a\nADD vendor.tar.gz /opt/\n", "unpack"),
    ("FROM a\nCOPY /etc/passwd /x\n", "inside the build context"),
    ("FROM a\nCOPY sub/../../x /x\n", "inside the build context"),
    ("FROM a\nCOPY onlyone\n", "a source and a destination"),
    ("FROM a\nCOPY <<EOF /x\nhi\nEOF\n", "heredocs"),
])
def test_copy_errors_name_their_line(text, words):
    exc = error(text)
    assert exc.line == 2 and words in exc.message


# --------------------------------------------------------------------------- ENV / ARG


def test_env_forms():
    assert body("""\
        FROM a
        ENV A=1 B="two words" C='single $NOT' D=x\\ y
        ENV LEGACY the rest of   the line
        ENV P=/opt/bin:$PATH Q=${HOME}/x E=\\$literal
    """) == [("ENV", ["A", "1", "B", "two words", "C", "single \\$NOT", "D", "x y"]),
             ("ENV", ["LEGACY", "the rest of   the line"]),
             ("ENV", ["P", "/opt/bin:$PATH", "Q", "${HOME}/x", "E", "\\$literal"])]


def test_variables_declared_earlier_are_substituted_unknown_ones_kept():
    got = steps("""\
        FROM a
        ARG VERSION=1.2
        ARG NODEFAULT
        ENV APP=/srv/app-$VERSION LATER=$NODEFAULT
        WORKDIR ${APP}
        COPY --chown=${OWNER:-user} app-${VERSION}/ ${APP}/
        USER ${NAME:-worker}
        ENV X=${VERSION:+set} Y=${VERSION:-unused} Z=${MISSING:+set}
    """)
    # an ARG without a default gives no step; USER and WORKDIR were set, so no E2B tail
    assert got == HEAD + [("ENV", ["VERSION", "1.2"]), ("ENV", ["APP", "/srv/app-1.2", "LATER", "$NODEFAULT"]),
                          ("WORKDIR", ["/srv/app-1.2"]),
                          ("COPY", ["app-1.2/", "/srv/app-1.2/", "${OWNER:-user}", ""]),
                          ("USER", ["${NAME:-worker}"]),
                          ("ENV", ["X", "set", "Y", "1.2", "Z", "${MISSING:+set}"])]


def test_an_env_value_the_builder_expands_is_not_substituted_later():
    got = body("FROM a\nENV P=/x:$PATH\nENV Q=$P\n")
    assert got == [("ENV", ["P", "/x:$PATH"]), ("ENV", ["Q", "$P"])]


def test_arg_with_several_defaults_is_one_env_step():
    assert body("FROM a\nARG A=1 B C=3\n") == [("ENV", ["A", "1", "C", "3"])]


@pytest.mark.parametrize("text, words", [
    ("FROM a\nENV\n", "a name and a value"),
    ("FROM a\nENV ONLY\n", "needs a value"),
    ("FROM a\nENV A=1 B\n", "key=value expected"),
    ("FROM a\nENV 1X=2\n", "not a valid variable name"),
    ("FROM a\nARG\n", "ARG needs a name"),
    ("FROM a\nENV A=\"open\n", "unterminated double quote"),
    ("FROM a\nENV A=${B\n", "missing '}'"),
    ("FROM a\nENV A=${B/x/y}\n", "unsupported modifier"),
])
def test_env_and_arg_errors(text, words):
    exc = error(text)
    assert exc.line == 2 and words in exc.message


# --------------------------------------------------------------------------- WORKDIR, USER, CMD


def test_workdir_and_user_replace_the_e2b_defaults():
    assert steps("FROM a\nWORKDIR /app\n") == HEAD + [("WORKDIR", ["/app"]), ("USER", ["user"])]
    assert steps("FROM a\nUSER nobody\n") == HEAD + [("USER", ["nobody"]), ("WORKDIR", ["/home/user"])]
    assert steps('FROM a\nWORKDIR "/my dir"\nUSER app:app\n') == HEAD + [("WORKDIR", ["/my dir"]),
                                                                          ("USER", ["app:app"])]
    assert error("FROM a\nWORKDIR\n").message == "WORKDIR needs an argument"
    assert error("FROM a\nUSER --x y\n").message == "USER takes no flags (--x)"
    assert error("FROM a\nCMD --port 80\n").message == "CMD takes no flags (--port)"  # as Docker


@pytest.mark.parametrize("lines, start", [
    (['CMD python3 -m http.server 8000'], "python3 -m http.server 8000"),
    (['CMD ["python3", "-m", "http.server"]'], "python3 -m http.server"),
    (['ENTRYPOINT ["tini", "--"]', 'CMD ["node", "my app.js"]'], "tini -- node 'my app.js'"),
    (['ENTRYPOINT ["/bin/run"]', "CMD serve --port 80 && x"], "/bin/run /bin/sh -c 'serve --port 80 && x'"),
    (['ENTRYPOINT exec server', 'CMD ["ignored"]'], "exec server"),
    (['CMD ["first"]', 'CMD ["second"]'], "second"),
    (['CMD []'], None),
])
def test_cmd_and_entrypoint_make_the_start_command(lines, start):
    assert parse("FROM a\n" + "\n".join(lines) + "\n").start_cmd == start


def test_metadata_instructions_are_ignored_with_warnings():
    recipe = parse("FROM a\nEXPOSE 80\nLABEL a=b\nMAINTAINER me\nSTOPSIGNAL SIGTERM\nVOLUME /data\nRUN true\n")
    assert [s.type for s in recipe.steps] == ["USER", "WORKDIR", "RUN", "USER", "WORKDIR"]
    assert recipe.warnings == [f"line {n}: {kw} is ignored (a template has no such metadata)"
                               for n, kw in enumerate(["EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "VOLUME"], 2)]


@pytest.mark.parametrize("instruction, words", [
    ('SHELL ["/bin/zsh", "-c"]', "SHELL is not supported"),
    ("HEALTHCHECK CMD curl -f localhost", "HEALTHCHECK is not supported"),
    ("ONBUILD RUN x", "ONBUILD is not supported"),
    ("FROBNICATE x", "unknown or unsupported instruction FROBNICATE"),
])
def test_other_instructions_are_refused_naming_the_line(instruction, words):
    exc = error(f"FROM a\nRUN true\n\n{instruction}\n")
    assert exc.line == 4 and words in exc.message and str(exc).startswith("line 4: ")


def test_lowercase_instructions_and_a_byte_order_mark():
    assert parse("\ufefffrom a\nrun echo hi\n").steps[2].args == ["echo hi"]


# --------------------------------------------------------------------------- the build context


@pytest.fixture
def ctx(tmp_path):
    root = tmp_path / "ctx"
    (root / "app" / "sub").mkdir(parents=True)
    (root / "app" / "server.py").write_text("print('hi')\n")
    (root / "app" / "sub" / "data.txt").write_text("data\n")
    (root / "app" / ".hidden").write_text("h\n")
    (root / "app" / "node_modules" / "pkg").mkdir(parents=True)
    (root / "app" / "node_modules" / "pkg" / "index.js").write_text("x\n")
    (root / "a.txt").write_text("a\n")
    (root / "b.log").write_text("b\n")
    os.symlink("a.txt", root / "link")
    return root


def rels(context, src):
    return [e.relpath for e in BuildContext(context).entries(src)]


def test_sources_directories_globs_and_symlinks(ctx):
    assert rels(ctx, "app/") == ["app", "app/.hidden", "app/node_modules", "app/node_modules/pkg",
                                 "app/node_modules/pkg/index.js", "app/server.py", "app/sub", "app/sub/data.txt"]
    assert rels(ctx, "*.txt") == ["a.txt"]
    assert rels(ctx, "app/**/*.txt") == ["app/sub/data.txt"]
    assert rels(ctx, "./a.txt") == ["a.txt"]
    assert rels(ctx, "link") == ["link"]
    assert "link" in rels(ctx, ".") and "." not in rels(ctx, ".")


def test_dockerignore_excludes_and_re_includes(ctx):
    (ctx / ".dockerignore").write_text("# comment\n\n**/node_modules\n*.log\napp/sub\n!app/sub/data.txt\n/link\n")
    assert rels(ctx, "app") == ["app", "app/.hidden", "app/server.py", "app/sub/data.txt"]
    assert "b.log" not in rels(ctx, ".") and "link" not in rels(ctx, ".")
    with pytest.raises(ContextError, match="dockerignore"):
        BuildContext(ctx).entries("b.log")


@pytest.mark.parametrize("patterns, path, excluded", [
    (["*.pyc"], "x.pyc", True), (["*.pyc"], "sub/x.pyc", False), (["**/*.pyc"], "sub/deep/x.pyc", True),
    (["build"], "build/out/x", True), (["b?ild"], "build", True), (["[a-c].txt"], "b.txt", True),
    (["[!a-c].txt"], "b.txt", False), (["docs", "!docs/keep.md"], "docs/keep.md", False),
    (["!x", "x"], "x", True), (["/abs"], "abs", True), (["./rel/"], "rel/f", True), (["a/**"], "a/b/c", True),
])
def test_dockerignore_patterns(patterns, path, excluded):
    assert DockerIgnore(patterns).excluded(path) is excluded
    assert DockerIgnore(patterns).excluded("") is False  # the context itself, never


def test_missing_and_escaping_sources(ctx):
    with pytest.raises(ContextError, match="no such file"):
        BuildContext(ctx).entries("nope/*")
    with pytest.raises(ContextError, match="outside the build context"):
        BuildContext(ctx).entries("../x")
    with pytest.raises(ContextError, match="not a directory"):
        BuildContext(ctx / "a.txt")


def test_files_hash_follows_content_mode_and_the_step_not_mtimes(ctx):
    entries = BuildContext(ctx).entries("app/")
    first = files_hash("app/", "/app", entries)
    assert len(first) == 64 and first == files_hash("app/", "/app", BuildContext(ctx).entries("app/"))
    assert files_hash("app/", "/srv", entries) != first
    os.utime(ctx / "app" / "server.py", (1, 1))
    assert files_hash("app/", "/app", BuildContext(ctx).entries("app/")) == first
    (ctx / "app" / "server.py").chmod(0o755)
    moded = files_hash("app/", "/app", BuildContext(ctx).entries("app/"))
    assert moded != first
    (ctx / "app" / "server.py").write_text("print('HI')\n")  # same size, other bytes
    assert files_hash("app/", "/app", BuildContext(ctx).entries("app/")) not in (first, moded)


def test_archive_members_are_relative_and_anonymous(ctx):
    out = io.BytesIO()
    write_archive(BuildContext(ctx).entries("app/sub") + BuildContext(ctx).entries("link"), out)
    raw = out.getvalue()
    assert raw[:2] == b"\x1f\x8b"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(raw))) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == ["app/sub", "app/sub/data.txt", "link"]
        assert members["app/sub"].isdir() and members["link"].issym() and members["link"].linkname == "a.txt"
        assert tar.extractfile("app/sub/data.txt").read() == b"data\n"
        assert all(m.uid == 0 and m.uname == "" for m in members.values())
