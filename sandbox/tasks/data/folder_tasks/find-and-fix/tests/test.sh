# every file as it must be: only the TODO line replaced
[ "$(cat src/lib/util.txt)" = "$(printf 'def f\ny = 2\nx = 42\nend')" ] || exit 1
[ "$(cat src/app/main.txt)" = "$(printf 'start\nrun tasks\nstop')" ] || exit 1
[ "$(cat src/lib/io.txt)" = "$(printf 'read\nwrite')" ] || exit 1
[ "$(cat fix.txt)" = "x = 42" ] || exit 1
exit 0
