grep -rn TODO src
cat fix.txt
sed -i 's/^.*TODO.*$/x = 42/' src/lib/util.txt
