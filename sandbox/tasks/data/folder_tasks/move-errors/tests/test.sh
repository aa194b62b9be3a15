# the two failed jobs moved (with their text), the four others left in place, nothing else
[ -f errors/job2.log ] && [ -f errors/job5.log ] || exit 1
grep -qx "ERROR disk full" errors/job2.log && grep -qx "ERROR timeout" errors/job5.log || exit 1
for i in 1 3 4 6; do [ -f "logs/job$i.log" ] || exit 1; done
[ ! -e logs/job2.log ] && [ ! -e logs/job5.log ] || exit 1
[ "$(ls -A errors | wc -l)" = 2 ] && [ "$(ls -A logs | wc -l)" = 4 ] || exit 1
exit 0
